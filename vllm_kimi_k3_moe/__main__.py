"""``python -m vllm_kimi_k3_moe``: the ``vllm-kimi-k3-moe`` command line."""

import sys

from vllm_kimi_k3_moe.tools.cli import main

sys.exit(main())
