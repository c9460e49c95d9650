"""The code of each fix's targets on each verified vLLM release, as
``record`` wrote it (``python -m vllm_kimi_k3_moe.verification.record`` on
each release): release -> patch module -> the digest of its targets' source
and a digest of each target's signature, in ``TARGETS`` order."""

from __future__ import annotations

from typing import Any

VERIFIED_CODE: dict[str, dict[str, Any]] = {
    "0.33.0": {
        "vllm_kimi_k3_moe.models.kimi_k3.nvidia.model": {
            "digest": "cd367579132d5372",
            "signatures": ["2a164d62fdbb"],
        },
        "vllm_kimi_k3_moe.models.kimi_k3.amd.linear": {
            "digest": "1a37304d95ff82be",
            "signatures": ["c1a63cce5d5d"],
        },
        "vllm_kimi_k3_moe.model_executor.layers.fused_moe.routed_experts": {
            "digest": "34c3d50b89b79cf9",
            "signatures": [
                "d4372379640c",
                "9b967bfa7e73",
                "a0b6002e8819",
                "727ea2519f98",
            ],
        },
        "vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading": {
            "digest": "ddf2b89591c4cf36",
            "signatures": [
                "412e4ca687f1",
                "7ea6aa402c6f",
                "1fdb5217538c",
                "aad038ca182e",
                "169325be6e20",
                "f4ca892d9e9f",
            ],
        },
        "vllm_kimi_k3_moe.model_executor.model_loader.default_loader": {
            "digest": "5782d6fec92d85b3",
            "signatures": ["accc0b8dd83e"],
        },
        "vllm_kimi_k3_moe.model_executor.layers.fused_moe.oracle.int_wna16": {
            "digest": "3bb3fb614da2e9ae",
            "signatures": ["913399dd8463", "0d8da78193bb"],
        },
        "vllm_kimi_k3_moe.model_executor.model_loader.reload.layerwise": {
            "digest": "995fa04acbf2e8a1",
            "signatures": ["1fdb5217538c"],
        },
        "vllm_kimi_k3_moe.model_executor.models.utils": {
            "digest": "494034f51aeab17a",
            "signatures": ["6cf5a025a888"],
        },
        "vllm_kimi_k3_moe.distributed.weight_transfer.base": {
            "digest": "d8d17597ebbe87ca",
            "signatures": ["80b0923064e8"],
        },
    },
    "0.34.0": {
        "vllm_kimi_k3_moe.models.kimi_k3.nvidia.model": {
            "digest": "c8a20471040fb007",
            "signatures": ["2a164d62fdbb"],
        },
        "vllm_kimi_k3_moe.models.kimi_k3.amd.linear": {
            "digest": "0336a78cbf2562c4",
            "signatures": ["c1a63cce5d5d"],
        },
        "vllm_kimi_k3_moe.model_executor.layers.fused_moe.routed_experts": {
            "digest": "56ff4f3c3836e006",
            "signatures": [
                "d4372379640c",
                "9b967bfa7e73",
                "a0b6002e8819",
                "727ea2519f98",
            ],
        },
        "vllm_kimi_k3_moe.model_executor.layers.fused_moe.strict_expert_loading": {
            "digest": "f22bf16740db96df",
            "signatures": [
                "412e4ca687f1",
                "7ea6aa402c6f",
                "8b7459f79cb0",
                "aad038ca182e",
                "169325be6e20",
                "f4ca892d9e9f",
            ],
        },
        "vllm_kimi_k3_moe.model_executor.model_loader.default_loader": {
            "digest": "5782d6fec92d85b3",
            "signatures": ["accc0b8dd83e"],
        },
        "vllm_kimi_k3_moe.model_executor.layers.fused_moe.oracle.int_wna16": {
            "digest": "9e3896fe14177de4",
            "signatures": ["1ddb4d4760ae", "ff836ff07992"],
        },
        "vllm_kimi_k3_moe.model_executor.model_loader.reload.layerwise": {
            "digest": "7d7da2f2ffeb4237",
            "signatures": ["8b7459f79cb0"],
        },
        "vllm_kimi_k3_moe.model_executor.model_loader.reload.direct": {
            "digest": "82fb2260238e7869",
            "signatures": ["44f803f2d859"],
        },
        "vllm_kimi_k3_moe.model_executor.model_loader.reload.plan": {
            "digest": "5ae921a5d8177553",
            "signatures": ["3144dd6ae313", "0615d245cd49"],
        },
        "vllm_kimi_k3_moe.model_executor.models.utils": {
            "digest": "67dc8fc8205cba4b",
            "signatures": ["6cf5a025a888"],
        },
        "vllm_kimi_k3_moe.distributed.weight_transfer.base": {
            "digest": "d8d17597ebbe87ca",
            "signatures": ["80b0923064e8"],
        },
    },
}
