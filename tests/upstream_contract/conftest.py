"""The Kimi-K3 fixtures (``tests/models/kimi_k3/conftest.py``), shared: a
contract test builds vLLM's layers as the plugin's tests do."""

from tests.models.kimi_k3.conftest import (  # noqa: F401 (fixtures)
    build_kimi_moe,
    format_experts,
    kimi_model,
    rank_config,
)
