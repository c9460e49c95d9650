"""The public Kimi-K3 speculative-decoding drafts ``plan`` resolves by name.

``plan --speculative-config`` names its draft as ``vllm serve`` does: a
local directory, or a Hugging Face id. ``plan`` downloads nothing; it builds
vLLM's draft model from the draft's ``config.json``, so the public drafts'
configs are kept here, each with where its values come from.

``Inferact/Kimi-K3-DSpark`` (the draft vLLM's Kimi-K3 recipe serves with
``--speculative-config '{"method": "dspark", "model":
"Inferact/Kimi-K3-DSpark", "num_speculative_tokens": 7}'``): the published
``config.json`` itself could not be read from here. Its values are those of
two public copies that each state they match it, and agree field for field:
an export script writing "config.json (matching Inferact/Kimi-K3-DSpark)"
and a conformance schema's expected config document (public code, found by
the project's code search). They agree with every public fact about the
draft: a ``K3DSparkModel`` (``k3_dspark``) of 5 dense MLA layers, hidden
7168, BF16, target hidden states from layers 2, 23, 47, 71 and 89, a
rank-256 Markov head, the target's 163840-token vocabulary
(its public descriptions; riverclouds/Kimi-K3-DSpark-for-
8L-dummy, "the Inferact/Kimi-K3-DSpark draft config" retargeted, changes
only those target layers); with 64 attention heads its parameters, with
the embedding its checkpoint carries and vLLM shares with the target, are
3,562,312,961, the 3.56 B published for it (68 tensors). vLLM's
``K3DSparkConfig`` reads it; the fields it ignores are kept as published.

``RedHatAI/Kimi-K3-speculator.dspark`` (sliding-window attention, the
Speculators library's format): no public copy of its ``config.json`` was
found (its model card gives 5 draft layers over target layers 24, 48, 72,
88 and 92, 4,744,900,481 parameters and a 2,048-token window, not its
widths), so none is kept and ``plan`` asks for a local copy instead of
inventing one. Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PublicDraft:
    """A public draft's ``config.json`` and where its values come from."""

    config: dict[str, Any]
    source: str


INFERACT_KIMI_K3_DSPARK: dict[str, Any] = {
    "architectures": ["K3DSparkModel"],
    "model_type": "k3_dspark",
    "hidden_size": 7168,
    "intermediate_size": 14336,
    "num_hidden_layers": 5,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": False,
    "mla_use_output_gate": False,
    "vocab_size": 163840,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 1048576,
    "rope_theta": 50000.0,
    "num_target_layers": 5,
    "target_hidden_size": 7168,
    "target_num_hidden_layers": 93,
    "target_layer_ids": [2, 23, 47, 71, 89],
    "mask_token_id": 163837,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "tie_word_embeddings": False,
    "draft_vocab_size": 163840,
    "torch_dtype": "bfloat16",
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 32768,
        "rope_theta": 50000.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}

PUBLIC_DRAFTS: dict[str, PublicDraft] = {
    "Inferact/Kimi-K3-DSpark": PublicDraft(
        INFERACT_KIMI_K3_DSPARK,
        "public copies stating they match its config.json (this module's docstring)",
    ),
}

# Public drafts whose config.json is not kept, and why.
NOT_KEPT: dict[str, str] = {
    "RedHatAI/Kimi-K3-speculator.dspark": (
        "no public copy of its config.json was found to keep in this package"
    ),
}
