"""The verdict on every fix for the vLLM this Python imports, as JSON on
stdout (what ``doctor`` prints fix by fix; no GPU needed)::

    python -m vllm_kimi_k3_moe.verification.report
"""

from __future__ import annotations

import json
import sys
from typing import Any

from vllm_kimi_k3_moe import PARTITION_PATCH, PATCHES
from vllm_kimi_k3_moe.compat import VERIFIED_VLLM_RELEASES
from vllm_kimi_k3_moe.verification import verdict

PROOF_PENDING = (
    "to be proven on a small layer of this deployment when vLLM builds its "
    "first Kimi-K3 layer (else nothing patched, and a warning says why)"
)


def report() -> dict[str, Any]:
    """Each fix's line, and the one line the plugin logs (None: none)."""
    from vllm.version import __version__

    verdicts = verdict.judge_all([patch for _, patch in PATCHES])
    decision = verdict.decide(
        verdicts, __version__, __version__ in VERIFIED_VLLM_RELEASES, PARTITION_PATCH
    )
    line = decision.line
    if decision.prove:  # the server says what its first layer proved
        line = f"{line}; {PROOF_PENDING}"
    return {
        "vllm": __version__,
        "fixes": verdict.fix_lines(verdicts),
        "line": line,
        "nothing_patched": decision.warning,
    }


def main() -> int:
    print(json.dumps(report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
