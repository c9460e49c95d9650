"""Record the code of the fixes' targets on the installed vLLM, a verified
release, into ``verified_code.py`` (run once per verified release, and
whenever a patch's ``TARGETS`` change)::

    python -m vllm_kimi_k3_moe.verification.record
"""

from __future__ import annotations

import importlib
import pprint
import sys
from pathlib import Path
from typing import Any

from vllm_kimi_k3_moe import PATCHES
from vllm_kimi_k3_moe.compat import VERIFIED_VLLM_RELEASES
from vllm_kimi_k3_moe.verification import targets as upstream
from vllm_kimi_k3_moe.verification.verdict import has_module, signature_digest
from vllm_kimi_k3_moe.verification.verified_code import VERIFIED_CODE

FILE = Path(__file__).with_name("verified_code.py")
HEADER = '''"""The code of each fix's targets on each verified vLLM release, as
``record`` wrote it (``python -m vllm_kimi_k3_moe.verification.record`` on
each release): release -> patch module -> the digest of its targets' source
and a digest of each target's signature, in ``TARGETS`` order."""

from __future__ import annotations

from typing import Any

'''


def code_of(patch: str) -> dict[str, Any]:
    """What is recorded of ``patch``'s targets on the installed vLLM."""
    declared = importlib.import_module(patch).TARGETS
    return {
        "digest": upstream.digest(declared),
        "signatures": [signature_digest(upstream.signature(t)) for t in declared],
    }


def _patches_something(patch: str) -> bool:
    """Whether ``patch`` has code to patch in this vLLM (``ONLY_WHERE``)."""
    only_where = getattr(importlib.import_module(patch), "ONLY_WHERE", None)
    return only_where is None or has_module(only_where)


def main() -> int:
    from vllm.version import __version__

    if __version__ not in VERIFIED_VLLM_RELEASES:
        print(f"vLLM {__version__} is not a verified release", file=sys.stderr)
        return 2
    recorded = dict(VERIFIED_CODE)
    recorded[__version__] = {
        patch: code_of(patch) for _, patch in PATCHES if _patches_something(patch)
    }
    ordered = {r: recorded[r] for r in VERIFIED_VLLM_RELEASES if r in recorded}
    body = pprint.pformat(ordered, width=80, sort_dicts=False)
    FILE.write_text(f"{HEADER}VERIFIED_CODE: dict[str, dict[str, Any]] = {body}\n")
    print(f"recorded vLLM {__version__} in {FILE} (run ruff format on it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
