"""What vLLM makes of AITER's SiTUv2 switches in a server's environment.

AITER picks the activation precision of Kimi-K3's SiTU MXFP4 MoE kernel
(CDNA4, AITER on: a4w4, a8w4 or a16w4) from ``AITER_SITUV2_A4W4`` and
``AITER_SITUV2_A8W4``, and public AMD launch lines set
``AITER_SITUV2_A8W4=1``. vLLM 0.33 and 0.34 set both itself in each of its
processes, when it imports ``vllm._aiter_ops`` (before any model is
built): from its own ``VLLM_ROCM_USE_AITER_MOE_SITUV2`` (``auto``, the
default, is a4w4) it sets the one it selects and removes the other
(``_sync_aiter_situv2_moe_env``). An ``AITER_SITUV2_*`` the operator sets
is replaced unless vLLM's variable asks for the same. The precision does
not change what a GPU allocates: vLLM's MXFP4 method takes the same backend
and partition for each (``tests/models/kimi_k3/amd/test_amd_situv2.py``).

vLLM's own functions decide, run on a copy of the environment: this
process's environment is left as it was.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from unittest import mock

from vllm_kimi_k3_moe.compat import VLLM

SITUV2_VARIABLE = "VLLM_ROCM_USE_AITER_MOE_SITUV2"
AITER_PREFIX = "AITER_SITUV2_"


class AiterEnvironmentError(ValueError):
    """A value of ``VLLM_ROCM_USE_AITER_MOE_SITUV2`` vLLM refuses; one line."""


@dataclass(frozen=True)
class Situv2Replaced:
    """AITER's SiTUv2 variables an environment sets and vLLM replaces."""

    given: dict[str, str]  # the AITER_SITUV2_* it sets that vLLM changes
    kept: dict[str, str]  # AITER's variables as vLLM leaves them set
    activation: str  # what vLLM selects: a4w4, a8w4 or a16w4
    setting: str | None  # VLLM_ROCM_USE_AITER_MOE_SITUV2 as given (None: unset)
    # the activation the given variables ask for, where one does
    asked: str | None

    def lines(self) -> list[str]:
        """``check``'s words for it: what vLLM uses, and what to set."""
        given = " ".join(f"{name}={value}" for name, value in self.given.items())
        setting = "unset: auto" if self.setting is None else f"={self.setting}"
        kept = " and ".join(f"{n}={v}" for n, v in self.kept.items()) or "neither"
        words = [
            f"{given} has no effect: {VLLM} sets AITER's SiTUv2 variables in "
            f"each of its processes, from {SITUV2_VARIABLE} ({setting}), to {kept}: "
            f"Kimi-K3's AITER MoE (CDNA4, AITER on) runs {self.activation}.",
            f"For {self.asked} set {SITUV2_VARIABLE}={self.asked} instead."
            if self.asked
            else f"Choose with {SITUV2_VARIABLE} (a4w4, a8w4 or a16w4).",
            "What each GPU allocates is the same either way.",
        ]
        return textwrap.wrap(
            " ".join(words),
            100,
            initial_indent="AITER       ",
            subsequent_indent=" " * 12,
            break_on_hyphens=False,
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "given": self.given,
            "vllm_sets": self.kept,
            "activation": self.activation,
            "instead": f"{SITUV2_VARIABLE}={self.asked}" if self.asked else None,
        }


def replaced_situv2(environment: Mapping[str, str]) -> Situv2Replaced | None:
    """What vLLM does to the ``AITER_SITUV2_*`` variables ``environment``
    (a server's, whole: read before this process imported vLLM, which sets
    them in its own) sets: None where it sets none, or sets them as vLLM
    will, or where this vLLM does not set them itself. Raises
    ``AiterEnvironmentError`` where vLLM refuses its own variable's value
    (it would not start)."""
    if not any(
        name.startswith(AITER_PREFIX) or name == SITUV2_VARIABLE for name in environment
    ):
        return None
    import vllm  # noqa: F401  (its import sets this process's environment)

    # vLLM's AITER module sets AITER's variables, and reads vLLM's, when it
    # is imported: here neither touches this process's environment
    with mock.patch.dict(os.environ):
        os.environ.pop(SITUV2_VARIABLE, None)
        from vllm import _aiter_ops
    resolve = getattr(_aiter_ops, "_resolve_situv2_activation", None)
    sync = getattr(_aiter_ops, "_sync_aiter_situv2_moe_env", None)
    names: dict[str, str] = getattr(_aiter_ops, "_AITER_SITUV2_ACT_ENV", {})
    if resolve is None or sync is None or not names:
        return None
    with mock.patch.dict(os.environ, environment, clear=True):
        try:
            activation = resolve()
        except ValueError as error:
            message = str(error).splitlines()[0]
            raise AiterEnvironmentError(f"{VLLM} would not start: {message}") from None
        sync()
        after = {name: os.environ.get(name) for name in names.values()}
    given = {
        name: value
        for name in names.values()
        if (value := environment.get(name)) is not None and after[name] != value
    }
    if not given:
        return None
    asked = [act for act, name in names.items() if environment.get(name) == "1"]
    return Situv2Replaced(
        given=given,
        kept={name: value for name, value in after.items() if value is not None},
        activation=activation,
        setting=environment.get(SITUV2_VARIABLE),
        asked=asked[0] if len(asked) == 1 and asked[0] != activation else None,
    )
