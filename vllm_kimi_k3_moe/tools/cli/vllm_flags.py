"""vLLM's own ``vllm serve`` flags, as the commands take them: defined once.

``plan``, ``check`` and ``selftest`` take the layout and serving options
under vLLM's long names (``--tensor-parallel-size``, ``--moe-backend``,
``--max-model-len``, ...), most with a short alias of their own (``--tp``),
so that a line of theirs reads as the ``vllm serve`` line it stands for.
``VLLM_FLAGS`` is that table: each flag's names, how it is parsed, and its
help where every command says the same; a command adds those it takes with
``add_vllm_flags``, giving only the words that are its own.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.formats import FORMAT_NAMES
from vllm_kimi_k3_moe.tools.cli.common import fraction, positive_int
from vllm_kimi_k3_moe.tools.deployment.topology import (
    DEFAULT_MAX_MODEL_LEN,
    KV_CACHE_DTYPES,
)


@dataclass(frozen=True)
class VllmFlag:
    """One of vLLM's flags: its names (the commands' alias first, then
    vLLM's), how ``argparse`` reads it, and its help where shared."""

    names: tuple[str, ...]
    parsed: dict[str, Any] = field(default_factory=dict)
    help: str | None = None


_SIZE = {"type": positive_int, "metavar": "N"}

VLLM_FLAGS: dict[str, VllmFlag] = {
    flag.names[-1]: flag
    for flag in (
        VllmFlag(("--tp", "--tensor-parallel-size"), {"dest": "tp_size", **_SIZE}),
        VllmFlag(
            ("--pp", "--pipeline-parallel-size"),
            {"dest": "pp_size", "default": 1, **_SIZE},
        ),
        VllmFlag(
            ("--dp", "--data-parallel-size"),
            {"dest": "dp_size", "default": 1, **_SIZE},
            "data-parallel size (default: 1)",
        ),
        VllmFlag(
            ("--ep", "--enable-expert-parallel"),
            {"dest": "expert_parallel", "action": "store_true"},
            "expert parallelism over TP x DP GPUs, as vLLM's flag of that name",
        ),
        VllmFlag(
            ("--dcp", "--decode-context-parallel-size"),
            {"dest": "dcp_size", "default": 1, **_SIZE},
            "decode-context-parallel size, dividing TP: the MLA KV cache is "
            "split over N GPUs of each TP group; no weight changes (default: 1)",
        ),
        VllmFlag(
            ("--pcp", "--prefill-context-parallel-size"),
            {"dest": "pcp_size", "default": 1, **_SIZE},
            "prefill-context-parallel size: only 1, vLLM's Kimi-K3 attention "
            "refuses more (default: 1)",
        ),
        VllmFlag(("--quantization",), {"type": str.lower}),
        VllmFlag(
            ("--quantization-config",),
            {"metavar": "JSON"},
            "vLLM's --quantization-config, with --quantization online or an "
            """online method's name over a BF16 checkpoint (e.g. '{"moe": """
            """"fp8_per_block"}'); passed to vLLM as given""",
        ),
        VllmFlag(("--moe-backend",), {"metavar": "NAME"}),
        VllmFlag(
            ("--kv-cache-dtype",),
            {"type": str.lower, "choices": KV_CACHE_DTYPES},
            "vLLM's --kv-cache-dtype: auto (bfloat16) or fp8 (default: auto); "
            "the table shows the KV cache with a GPU size",
        ),
        VllmFlag(
            ("--max-model-len",),
            {"metavar": "N"},
            "vLLM's --max-model-len, in tokens, as vLLM reads it (131072, 128k "
            f"= 128000, 128K = 131072; default: {DEFAULT_MAX_MODEL_LEN}); the "
            "table shows the KV cache with a GPU size",
        ),
        VllmFlag(
            ("--gpu-memory-utilization",),
            {"type": fraction, "metavar": "U"},
            "the share of each GPU vLLM takes, in (0, 1] (default: unset, "
            f"what {VLLM} resolves it to, which plan's notes say; the serve "
            "commands carry it only where given); needs a GPU size",
        ),
        VllmFlag(
            ("--speculative-config",),
            {"metavar": "JSON"},
            "vLLM's --speculative-config, as vllm serve takes it: method "
            '"dspark" with its draft ("model": a directory holding its '
            'config.json, or Inferact/Kimi-K3-DSpark) or "mtp" (the '
            "checkpoint's own MTP layers); vLLM builds the draft, its weights "
            "and KV cache are counted, and the serve commands carry it",
        ),
        VllmFlag(
            ("--language-model-only",),
            {"action": "store_true"},
            "as vLLM's flag: serve without the vision tower (by default "
            "vLLM loads it: 0.9 GB per GPU of the first pipeline stage)",
        ),
    )
}


def add_vllm_flag(
    command: argparse.ArgumentParser,
    name: str,
    help: str | None = None,
    **parsed: Any,
) -> None:
    """vLLM's flag ``name`` (its long name) on ``command``: the table's
    parsing, ``parsed`` over it, and ``help`` or the table's."""
    flag = VLLM_FLAGS[name]
    command.add_argument(
        *flag.names, **{**flag.parsed, **parsed}, help=help or flag.help
    )


def add_vllm_flags(command: argparse.ArgumentParser, *names: str) -> None:
    """vLLM's flags ``names`` on ``command``, each with the table's help."""
    for name in names:
        add_vllm_flag(command, name)


def add_dp_and_ep(command: argparse.ArgumentParser) -> None:
    add_vllm_flags(command, "--data-parallel-size", "--enable-expert-parallel")


def add_context_parallel(command: argparse.ArgumentParser) -> None:
    """``--dcp`` and ``--pcp``, as vLLM's flags of those long names."""
    add_vllm_flags(
        command, "--decode-context-parallel-size", "--prefill-context-parallel-size"
    )


def add_format_and_backend(
    command: argparse.ArgumentParser, online: bool = False
) -> None:
    """``--quantization`` and ``--moe-backend``, as ``plan`` takes them
    (``online``: also vLLM's methods that quantize a BF16 checkpoint while
    loading it, which ``tools.plan.asked`` checks against vLLM's list)."""
    formats = (
        "the checkpoint's format, with its published quantization config: "
        "mxfp4 (the release, compressed-tensors mxfp4-pack-quantized, which "
        "vLLM serves as native MXFP4), ct-mxfp4 (other compressed-tensors "
        "MXFP4), fp8-block, nvfp4 (compressed-tensors), modelopt-nvfp4, "
        "w4a16 (INT4 in groups of 32), awq, gptq (INT4 in groups of 128), "
        "bf16 (default: what --config's quantization_config declares, any "
        "config vLLM takes, else mxfp4)"
    )
    if online:
        formats += (
            "; or a method of vLLM's --quantization that quantizes the BF16 "
            "checkpoint while loading it (fp8_per_block, fp8_per_tensor, "
            "fp8_per_channel, mxfp8, int8_per_channel_weight_only, "
            "nvfp4_per_token, fp8, experts_int8, ...: vLLM's names, as vllm "
            "serve takes them; mxfp4 names the release, or with --config of a "
            "BF16 checkpoint vLLM's online MXFP4)"
        )
    add_vllm_flag(
        command,
        "--quantization",
        formats,
        metavar="NAME" if online else None,
        choices=None if online else FORMAT_NAMES,
    )
    add_vllm_flag(
        command,
        "--moe-backend",
        "vLLM's --moe-backend, the MoE kernel (default: marlin; the "
        "format's choices are below); 'auto' is refused: vLLM resolves it "
        "from the GPU it starts on",
        default="marlin",
    )
