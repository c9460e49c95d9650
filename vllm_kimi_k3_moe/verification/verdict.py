"""Which fixes go on in this vLLM: every patch module judged on its declared
targets (``TARGETS``, ``relied_on``, ``in_vllm``: the package docstring),
then all or nothing.

Judging imports the modules the targets are in (vLLM has imported most of
them by the time it imports its Kimi-K3 model, when this runs) and reads
their source: no layer is built, no CUDA is touched.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_kimi_k3_moe.verification import targets as upstream
from vllm_kimi_k3_moe.verification.verified_code import VERIFIED_CODE

VERIFIED = "verified"  # the code of a verified release
CHECKED = "checked"  # other code, every target and what the patch relies on there
IN_VLLM = "in vLLM"  # vLLM's own code does it: not applied
# verified code, but other code (an RL framework, another plugin) replaced a
# target at run time: applied once a small layer proves the fixes with the
# replacement in place (``fused_moe.proof.small_layer``)
REPLACED = "replaced at run time"
DIFFERS = "differs"  # not applied, and nothing else is
# the vLLM code the patch is for is not in this vLLM (``ONLY_WHERE``: vLLM
# 0.33 has no load plans): not applied, nothing to fix there
ABSENT = "nothing to patch"


@dataclass(frozen=True)
class FixVerdict:
    patch: str  # the plugin's patch module
    state: str  # VERIFIED, CHECKED, REPLACED, IN_VLLM, ABSENT or DIFFERS
    detail: str  # the release whose code it is, or what differed / is in vLLM
    # each target other code replaced at run time, and by what (module.function)
    replaced: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        """The patch as the lines name it: its module's last part."""
        return self.patch.rsplit(".", 1)[-1]

    @property
    def applies(self) -> bool:
        return self.state in (VERIFIED, CHECKED, REPLACED)


def _recorded(patch: str) -> dict[str, dict[str, Any]]:
    """Release -> what was recorded of ``patch``'s targets on it."""
    return {
        release: code[patch] for release, code in VERIFIED_CODE.items() if patch in code
    }


def signature_digest(signature: str) -> str:
    """What is recorded of a signature (``record``)."""
    return hashlib.sha256(signature.encode()).hexdigest()[:12]


def _at(recorded: Sequence[str], index: int) -> str | None:
    return recorded[index] if index < len(recorded) else None


def judge(patch: str) -> FixVerdict:
    """The verdict on one patch module, on the vLLM this process imports:
    its installed code (``targets.source``), and any target other code
    replaced at run time (``targets.replacement``)."""
    module = importlib.import_module(patch)
    declared: Sequence[str] = module.TARGETS
    recorded = _recorded(patch)

    def verdict(state: str, detail: str, replaced: Any = ()) -> FixVerdict:
        return FixVerdict(patch, state, detail, tuple(replaced))

    only_where = getattr(module, "ONLY_WHERE", None)
    if only_where is not None and not has_module(only_where):
        short = ".".join(only_where.split(".")[-2:])
        return verdict(ABSENT, f"this vLLM has no {short}")

    try:
        digest = upstream.digest(declared)
        replaced = [(t, r) for t in declared if (r := upstream.replacement(t))]
    except upstream.TargetMissing as missing:
        return verdict(DIFFERS, str(missing))
    except (OSError, TypeError) as unreadable:  # no source shipped
        return verdict(DIFFERS, f"source unreadable: {unreadable}")
    same = [r for r, code in recorded.items() if code["digest"] == digest]
    if same:
        # the release this vLLM calls itself where its code is that one's
        from vllm.version import __version__

        named = __version__ if __version__ in same else same[-1]
        if replaced:
            return verdict(REPLACED, f"the code of vLLM {named}", replaced)
        return verdict(VERIFIED, f"the code of vLLM {named}")
    try:
        for index, target in enumerate(declared):
            found = upstream.signature(target)
            known = {_at(code["signatures"], index) for code in recorded.values()}
            if signature_digest(found) not in known:
                return verdict(DIFFERS, f"{target} has another signature: {found}")
    except upstream.ReplacedOutOfReach as out_of_reach:
        return verdict(DIFFERS, str(out_of_reach))
    find: Callable[[str], Any] = upstream.find
    relied_on = getattr(module, "relied_on", None)
    missing = relied_on(find) if relied_on is not None else None
    if missing is not None:
        return verdict(DIFFERS, missing)
    in_vllm = getattr(module, "in_vllm", None)
    done = in_vllm(find) if in_vllm is not None else None
    if done is not None:
        return verdict(IN_VLLM, done)
    return verdict(CHECKED, "other code, checked", replaced)


def has_module(name: str) -> bool:
    """Whether this vLLM has the module ``name`` (not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package missing
        return False


def judge_all(patches: Sequence[str]) -> list[FixVerdict]:
    """Each patch's verdict; never raises (an error is a difference)."""
    verdicts = []
    for patch in dict.fromkeys(patches):
        try:
            verdicts.append(judge(patch))
        except Exception as error:  # a difference must never stop vLLM
            why = f"{type(error).__name__}: {error}".replace("\n", " ")
            verdicts.append(FixVerdict(patch, DIFFERS, why))
    return verdicts


@dataclass(frozen=True)
class Decision:
    """What the plugin does on this vLLM, and the one line it logs."""

    apply: tuple[str, ...]  # patch modules to apply, in order
    warning: bool  # the line is a warning (nothing patched)
    line: str | None  # None: verified code of a verified release, nothing to say
    # some fix goes on code it was not verified on: the first layer built
    # proves the fixes on a small layer first (``proof.small_layer``), and the line
    # is logged then, with what was proven (or the plugin steps aside)
    prove: bool = False
    # why the fixes need that proof, as the warning says it if it fails
    cause: str = ""
    # where the proof fails: what the warning asks of the operator
    remedy: str = ""
    # every fix is on code of a verified release (only replaced at run time)
    verified_code: bool = False


REPORT = "Please report it (README: Release policy)."


def short_name(target: str) -> str:
    """A target as the lines name it: its module's last part and its name
    (``meta.materialize_meta_tensor``)."""
    module, _, qualname = target.partition(":")
    return f"{module.rsplit('.', 1)[-1]}.{qualname}"


def replacements(verdicts: Sequence[FixVerdict]) -> str:
    """Each target other code replaced at run time, and by what, once."""
    named = {(t, by): None for v in verdicts for t, by in v.replaced}
    return "; ".join(f"{short_name(t)} by {by}" for t, by in named)


def decide(
    verdicts: Sequence[FixVerdict],
    vllm_version: str,
    plain: bool,
    prover: str | None = None,
) -> Decision:
    """All or nothing over ``verdicts``. ``plain``: this vLLM calls itself a
    verified release (then verified code needs no line). ``prover``: the
    patch whose first layer built proves the fixes on a small layer, where
    it goes on and some fix is only checked (``Decision.prove``)."""
    differs = [v for v in verdicts if v.state == DIFFERS]
    if differs:
        what = "; ".join(f"{v.name}: {v.detail}" for v in differs)
        return Decision(
            (),
            True,
            f"vllm-kimi-k3-moe: nothing patched on vLLM {vllm_version}, its code "
            f"differs from the code the plugin was verified on ({what}); vLLM runs "
            f"as it would alone. {REPORT}",
        )
    apply = tuple(v.patch for v in verdicts if v.applies)
    in_vllm = [v for v in verdicts if v.state == IN_VLLM]
    if plain and all(v.state in (VERIFIED, ABSENT) for v in verdicts):
        return Decision(apply, False, None)
    line = f"vllm-kimi-k3-moe: verified on this vLLM ({vllm_version}): "
    line += ", ".join(v.name for v in verdicts if v.applies) + " applied"
    if in_vllm:
        line += "; already in vLLM, not applied: " + "; ".join(
            f"{v.name} ({v.detail})" for v in in_vllm
        )
    checked = any(v.state == CHECKED for v in verdicts)
    replaced = replacements(verdicts)
    if replaced:
        line += f"; replaced at run time by other code: {replaced}"
    if checked:
        cause = "its code differs from the code the plugin was verified on"
        remedy = REPORT
    else:
        cause = f"other code replaced what its fixes call ({replaced})"
        remedy = (
            "A replacement that calls vLLM's own function and returns what it "
            "returns keeps the fixes (README: Release policy)."
        )
    prove = (checked or bool(replaced)) and prover in apply
    return Decision(apply, False, line, prove, cause, remedy, not checked)


def fix_lines(verdicts: Sequence[FixVerdict]) -> list[str]:
    """One line per fix, as ``doctor`` prints them."""
    decision = decide(verdicts, "", plain=True)
    lines = []
    for v in verdicts:
        on = v.patch in decision.apply
        what = "on " if on else "n/a" if v.state == ABSENT else "off"
        lines.append(f"{what} {v.name}: {v.state}, {v.detail}")
        if v.replaced:  # the line then says by what (``doctor``)
            lines[-1] += " (" + "; ".join(short_name(t) for t, _ in v.replaced) + ")"
    return lines
