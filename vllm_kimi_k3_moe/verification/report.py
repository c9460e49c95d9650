"""The verdict on every fix for the vLLM this Python imports, as JSON on
stdout (what ``doctor`` prints fix by fix; no GPU needed), for the Kimi-K3
model this platform builds (``compat.kimi_k3_model_module``: NVIDIA's, or
the AMD one on ROCm and XPU), as a server judges them: after vLLM's general
plugins are loaded, as every vLLM process loads them, so that a target
another plugin replaces at run time is seen (and named) here too::

    python -m vllm_kimi_k3_moe.verification.report
"""

from __future__ import annotations

import json
import sys
from typing import Any

from vllm_kimi_k3_moe import PARTITION_PATCH, patches_judged_with
from vllm_kimi_k3_moe.compat import VERIFIED_VLLM_RELEASES, kimi_k3_model_module
from vllm_kimi_k3_moe.verification import verdict

PROOF_PENDING = (
    "to be proven on a small layer of this deployment when vLLM builds its "
    "first Kimi-K3 layer (else nothing patched, and a warning says why)"
)


def report() -> dict[str, Any]:
    """Each fix's line, and the one line the plugin logs (None: none)."""
    from vllm.plugins import load_general_plugins
    from vllm.version import __version__

    load_general_plugins()  # what other plugins replace, they replace now
    model = kimi_k3_model_module()
    verdicts = verdict.judge_all(patches_judged_with({model}))
    decision = verdict.decide(
        verdicts, __version__, __version__ in VERIFIED_VLLM_RELEASES, PARTITION_PATCH
    )
    line = decision.line
    if decision.prove:  # the server says what its first layer proved
        line = f"{line}; {PROOF_PENDING}"
    return {
        "vllm": __version__,
        "model": model,
        "fixes": verdict.fix_lines(verdicts),
        "replaced": [
            f"{verdict.short_name(target)} by {by}"
            for target, by in dict.fromkeys(r for v in verdicts for r in v.replaced)
        ],
        "line": line,
        "nothing_patched": decision.warning,
    }


def main() -> int:
    print(json.dumps(report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
