"""A ``vllm serve`` command line, read back into the layout it asks for.

``check --serve-command`` takes the line ``plan`` printed (or any other):
vLLM's own ``vllm serve`` argument parser reads it, so its aliases
(``-tp 8``), ``--flag=value`` forms, repeated options (the last wins) and
every option unrelated to the layout are taken exactly as ``vllm serve``
takes them. A line of a launch over several nodes (``--nnodes``,
``--node-rank``, ``--headless``: any node's line ``plan`` prints) is held
to vLLM's launch rules (``nodes.validate_launch``). What is asked of the
topology is then validated by the same rules, with the same words, as
``plan`` (``topology.validate_topology``,
``validate_prefill_context_parallel``). ``NAME=VALUE`` words before
``vllm serve`` are the environment the line gives the server, as a shell
reads them (``plan`` prints AITER's switch so on an AMD GPU). The words
are split, and a line that is not ``vllm serve ...`` refused, before vLLM
is imported; so is a model that is not a local directory where the line names it plainly
(``named_model``), since ``check`` reads a downloaded checkpoint.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from vllm_kimi_k3_moe.tools.deployment.nodes import NodeSplit, validate_launch
from vllm_kimi_k3_moe.tools.deployment.topology import DeploymentError, Topology
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import a_cuda_platform_for_the_parser


class ServeCommandError(DeploymentError):
    """A serve command that cannot be read; the message is one line."""


@dataclass(frozen=True)
class ServeLine:
    """What a ``vllm serve`` line asks for, as far as ``check`` needs it."""

    model: str  # the positional model (or --model)
    topology: Topology
    pcp_size: int  # --prefill-context-parallel-size
    moe_backend: str  # --moe-backend ("auto" when not given)
    nodes: NodeSplit  # --nnodes, as vLLM splits the world over them
    node_rank: int  # --node-rank
    headless: bool  # --headless: a node other than the API server's
    quantization: str | None = None  # --quantization, as vLLM's parser read it
    # --quantization-config's JSON, as the line gives it (the last one)
    quantization_config: str | None = None
    # the NAME=VALUE words before ``vllm serve`` (``VLLM_ROCM_USE_AITER=1``)
    environment: tuple[tuple[str, str], ...] = ()


def _without_line_continuations(command: str) -> str:
    """``command`` as a POSIX shell reads it before splitting words: a
    backslash before a newline joins the two lines, except between single
    quotes (where a backslash is itself). ``shlex`` would keep the newline,
    a word of its own that vLLM's parser then refuses; ``plan`` breaks its
    long lines so (``\\`` at a line's end, the next indented)."""
    kept: list[str] = []
    quote = ""  # the quote character the scan is inside, if any
    index = 0
    while index < len(command):
        char = command[index]
        if char == "\\" and quote != "'":
            pair = command[index : index + 2]
            if command.startswith("\\\r\n", index):  # a line pasted from Windows
                pair = "\\\r\n"
            elif pair != "\\\n":
                kept.append(pair)  # an escaped character stays escaped
            index += len(pair)
            continue
        if char in "'\"" and quote in ("", char):
            quote = "" if quote else char
        kept.append(char)
        index += 1
    return "".join(kept)


# a shell's variable assignment before a command: NAME=VALUE
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.DOTALL)


def _environment_and_words(command: str) -> tuple[dict[str, str], list[str]]:
    """``command``'s leading ``NAME=VALUE`` words (the environment a shell
    gives the command) and the arguments after ``vllm serve``."""
    try:
        words = shlex.split(_without_line_continuations(command))
    except ValueError as error:
        raise ServeCommandError(f"--serve-command: {error}") from None
    environment = {}
    while words and (assignment := _ASSIGNMENT.fullmatch(words[0])):
        environment[assignment.group(1)] = assignment.group(2)
        words = words[1:]
    if words[:2] != ["vllm", "serve"]:
        raise ServeCommandError(
            "--serve-command must start with 'vllm serve' (after any NAME=VALUE "
            f"environment), got {command[:40]!r}"
        )
    return environment, words[2:]


def serve_words(command: str) -> list[str]:
    """The arguments after ``vllm serve`` (no vLLM import), the words split
    as a shell splits them: a line continued over several (``\\`` at a
    line's end, as ``plan`` prints a long line) is one line; the
    ``NAME=VALUE`` words before it are its environment
    (``serve_environment``)."""
    return _environment_and_words(command)[1]


def serve_environment(command: str) -> dict[str, str]:
    """The ``NAME=VALUE`` words before ``vllm serve`` (``plan`` prints
    ``VLLM_ROCM_USE_AITER=1 vllm serve ...`` where AITER is planned)."""
    return _environment_and_words(command)[0]


def named_model(words: list[str]) -> str | None:
    """The model a serve line's words name where that needs no parser:
    ``vllm serve MODEL ...`` (vLLM's positional ``model_tag``, which wins
    over ``--model``), else ``--model X`` or ``--model=X``. None otherwise:
    vLLM's parser finds it."""
    if words and not words[0].startswith("-"):
        return words[0]
    for index, word in enumerate(words):
        if word == "--model" and index + 1 < len(words):
            return words[index + 1]
        if word.startswith("--model="):
            return word.removeprefix("--model=")
    return None


def given_json(words: list[str], option: str) -> str | None:
    """The text of the last ``option VALUE`` or ``option=VALUE`` in
    ``words`` (vLLM's parser keeps the last too, but hands back what it
    made of the JSON, not the JSON)."""
    found = None
    for index, word in enumerate(words):
        if word == option and index + 1 < len(words):
            found = words[index + 1]
        elif word.startswith(f"{option}="):
            found = word.removeprefix(f"{option}=")
    return found


def read_serve_command(command: str) -> ServeLine:
    """``command`` read by vLLM's ``vllm serve`` parser (imports vLLM)."""
    environment, words = _environment_and_words(command)
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class OneLineParser(FlexibleArgumentParser):
        """vLLM's parser, its error one line instead of its usage and exit."""

        def error(self, message: str):  # type: ignore[override]
            raise ServeCommandError(f"vllm serve's parser: {' '.join(message.split())}")

    with a_cuda_platform_for_the_parser():
        parser = make_arg_parser(OneLineParser(prog="vllm serve"))
    args = parser.parse_args(words)
    quantization_config = given_json(words, "--quantization-config")
    if args.quantization_config is not None and quantization_config is None:
        raise ServeCommandError(
            "--serve-command: check reads --quantization-config given as one "
            "JSON word (--quantization-config '{...}')"
        )
    topology = Topology(
        args.tensor_parallel_size,
        dp_size=args.data_parallel_size,
        expert_parallel=args.enable_expert_parallel,
        pp_size=args.pipeline_parallel_size,
        dcp_size=args.decode_context_parallel_size,
    )
    try:
        nodes = validate_launch(
            topology, args.nnodes, args.node_rank, args.data_parallel_backend
        )
    except DeploymentError as error:
        raise ServeCommandError(f"vllm serve's launch rules: {error}") from None
    return ServeLine(
        model=args.model_tag or args.model,
        topology=topology,
        pcp_size=args.prefill_context_parallel_size,
        moe_backend=args.moe_backend,
        nodes=nodes,
        node_rank=args.node_rank,
        headless=args.headless,
        quantization=args.quantization,
        quantization_config=quantization_config,
        environment=tuple(environment.items()),
    )
