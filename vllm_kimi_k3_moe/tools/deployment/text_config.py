"""Kimi-K3's text config: the published values and reading a ``config.json``.

Kimi-K3's Hugging Face ``config.json`` nests the language model under
``text_config``. The embedded values are Kimi-K3's published ``text_config``
(vLLM 0.33.0's Kimi-K3 support builds its layers from the same fields), in
three parts: what shapes a MoE layer (all ``check`` reads), the attention
layers (MLA and KDA), and the embeddings and dense layer. ``plan`` needs all
three to build the whole language model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

KIMI_K3_MOE_FIELDS: dict[str, Any] = {
    "hidden_size": 7168,  # residual width
    "routed_expert_hidden_size": 3584,  # latent MoE width: what the experts see
    "moe_intermediate_size": 3072,  # per routed expert
    "num_experts": 896,  # routed experts per MoE layer
    "num_experts_per_token": 16,  # top-16 routing
    "num_shared_experts": 2,
    "num_hidden_layers": 93,
    "first_k_dense_replace": 1,  # layer 0 is dense: 92 MoE layers
    "moe_layer_freq": 1,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 1.0,
    "latent_moe_use_norm": True,  # an RMSNorm on the latent expert input
    "rms_norm_eps": 1e-5,
}

# Kimi-K3's attention: 24 MLA layers and 69 KDA (linear attention) layers.
KIMI_K3_FULL_ATTENTION_LAYERS = [*range(4, 93, 4), 93]  # 1-based: the MLA layers
KIMI_K3_ATTENTION_FIELDS: dict[str, Any] = {
    "num_attention_heads": 96,
    "num_key_value_heads": 96,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    # vLLM's KimiLinearConfig numbers these layer lists from 1, as the published
    # config does: is_kda_layer(i) tests i + 1 for the 0-based layer index i.
    "linear_attn_config": {
        "num_heads": 96,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
        "gate_lower_bound": -5.0,
        "full_attn_layers": KIMI_K3_FULL_ATTENTION_LAYERS,
        "kda_layers": [  # the other 69
            n for n in range(1, 94) if n not in KIMI_K3_FULL_ATTENTION_LAYERS
        ],
    },
    "attn_res_block_size": 12,
}
# The vocabulary (embeddings and lm_head), the dense MLP of layer 0, and the
# MTP draft layers (none published).
KIMI_K3_EMBEDDING_AND_DENSE_FIELDS: dict[str, Any] = {
    "vocab_size": 163840,
    "intermediate_size": 33792,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}
# Kimi-K3's published text_config: what ``plan`` builds without --config.
KIMI_K3_TEXT_CONFIG: dict[str, Any] = {
    **KIMI_K3_MOE_FIELDS,
    **KIMI_K3_ATTENTION_FIELDS,
    **KIMI_K3_EMBEDDING_AND_DENSE_FIELDS,
}

# Without these a config does not describe a MoE model the planner can size;
# the other fields fall back to vLLM's KimiLinearConfig defaults.
REQUIRED_FIELDS = (
    "hidden_size",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_token",
    "num_hidden_layers",
)
# Without these a config does not describe Kimi-K3's attention (MLA and KDA)
# and embeddings, and ``plan`` cannot build the whole language model.
LANGUAGE_MODEL_INTEGER_FIELDS = (
    "vocab_size",
    "intermediate_size",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
LANGUAGE_MODEL_FIELDS = (*LANGUAGE_MODEL_INTEGER_FIELDS, "linear_attn_config")
LINEAR_ATTENTION_FIELDS = ("num_heads", "head_dim", "kda_layers", "full_attn_layers")
# Read from a config.json when set, beyond the embedded fields.
OPTIONAL_FIELDS = ("num_nextn_predict_layers",)  # MTP draft layers, after the main ones
# What vLLM's topology rules read (``topology.validate_topology``: whole
# heads and vocabulary rows per TP rank): read when set, so that ``check``
# refuses what ``plan`` refuses for the same config.json.
TOPOLOGY_FIELDS = ("vocab_size", "num_attention_heads", "linear_attn_config")
# Integer fields and their smallest valid value, checked when set.
INTEGER_FIELDS = {
    **dict.fromkeys(REQUIRED_FIELDS, 1),
    "routed_expert_hidden_size": 1,
    "num_shared_experts": 0,
    "first_k_dense_replace": 0,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    **dict.fromkeys(LANGUAGE_MODEL_INTEGER_FIELDS, 1),
}


class ConfigFileError(ValueError):
    """A ``config.json`` that cannot be used; the message is one line."""


# The model_type of Kimi-K3's config.json and of its language model
# (vLLM's KimiK3Config and KimiLinearConfig): a config of another
# model_type is another model, named as such rather than by what it lacks.
KIMI_K3_MODEL_TYPES = ("kimi_k3", "kimi_linear")


def refuse_another_model(document: dict[str, Any], path: Path) -> None:
    """``ConfigFileError`` naming the model a ``config.json`` of another
    ``model_type`` (llama, deepseek_v3, ...) describes."""
    model_type = document.get("model_type")
    if isinstance(model_type, str) and model_type not in KIMI_K3_MODEL_TYPES:
        name = model_type.split("_")[0]
        article = "an" if name[:1] in tuple("aeiou") else "a"
        raise ConfigFileError(
            f"config file {path} is {article} {name} model (model_type "
            f"{model_type!r}), not Kimi-K3"
        )


def _is_moe_layer(text_config: dict[str, Any], index: int) -> bool:
    """As vLLM's ``KimiDecoderLayer`` decides (the MTP block's layer too)."""
    first = text_config.get("first_k_dense_replace", 0)
    return index >= first and index % text_config.get("moe_layer_freq", 1) == 0


def main_moe_layers(text_config: dict[str, Any]) -> list[int]:
    """Indices of the main model's MoE layers."""
    layers = range(text_config["num_hidden_layers"])
    return [index for index in layers if _is_moe_layer(text_config, index)]


def moe_layer_count(text_config: dict[str, Any]) -> int:
    return len(main_moe_layers(text_config))


def mtp_moe_layers(text_config: dict[str, Any]) -> list[int]:
    """Indices of the MTP draft's MoE layers, numbered after the main model's
    layers as the checkpoint names them."""
    first = text_config["num_hidden_layers"]
    count = text_config.get("num_nextn_predict_layers", 0)
    return [i for i in range(first, first + count) if _is_moe_layer(text_config, i)]


def one_layer_of_each(text_config: dict[str, Any]) -> dict[str, Any]:
    """``text_config`` cut to two layers, a dense one and an MoE one like
    every MoE layer of the model: what building the MLPs under another
    sharding costs, through the same build as the whole model."""
    linear = dict(text_config.get("linear_attn_config") or {})
    linear.update(kda_layers=[1], full_attn_layers=[2])
    return {
        **text_config,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": linear,
    }


def read_config_document(path: Path) -> dict[str, Any]:
    """The JSON object in a Hugging Face ``config.json``."""
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigFileError(f"config file {path} does not exist") from None
    except OSError as error:  # its reason, without errno's [Errno N] and path
        why = error.strerror or type(error).__name__
        raise ConfigFileError(f"cannot read config file {path}: {why}") from None
    except UnicodeDecodeError:
        raise ConfigFileError(f"config file {path} is not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise ConfigFileError(f"config file {path} is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise ConfigFileError(f"config file {path} does not hold a JSON object")
    return document


def text_config_fields(document: dict[str, Any], path: Path) -> dict[str, Any]:
    """The validated MoE fields of a config document's language model (nested
    under ``text_config`` in Kimi-K3's multimodal config), and the fields
    vLLM's topology rules read, where set."""
    nested = "text_config" in document
    text_config = document["text_config"] if nested else document
    where = "text_config" if nested else "the top level"
    if not isinstance(text_config, dict):
        raise ConfigFileError(f"config file {path}: text_config is not an object")
    missing = [name for name in REQUIRED_FIELDS if text_config.get(name) is None]
    if missing:
        refuse_another_model(document, path)
        raise ConfigFileError(
            f"config file {path} lacks {', '.join(missing)} in {where}"
        )
    for name, minimum in INTEGER_FIELDS.items():
        value = text_config.get(name)
        if value is None:  # absent or null: vLLM's default applies
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigFileError(
                f"config file {path}: {name} must be an integer of at least "
                f"{minimum}, got {value!r}"
            )
    fields = {
        name: text_config[name]
        for name in (*KIMI_K3_MOE_FIELDS, *OPTIONAL_FIELDS, *TOPOLOGY_FIELDS)
        if text_config.get(name) is not None
    }
    if not isinstance(fields.get("linear_attn_config", {}), dict):
        raise ConfigFileError(
            f"config file {path}: linear_attn_config must be an object, got "
            f"{fields['linear_attn_config']!r}"
        )
    refuse_per_layer_expert_counts(text_config, path)
    return fields


def refuse_per_layer_expert_counts(text_config: dict[str, Any], path: Path) -> None:
    """Refuse a config that gives its layers different expert counts (what
    pruning each layer on its own writes, under a name of its choosing): vLLM
    reads ``num_experts`` alone and builds every MoE layer with it, so such
    a checkpoint does not load."""
    for name, value in text_config.items():
        counts = value if isinstance(value, list) else None
        if (
            "expert" in name
            and counts
            and all(isinstance(n, int) and not isinstance(n, bool) for n in counts)
            and len(set(counts)) > 1
        ):
            raise ConfigFileError(
                f"config file {path}: {name} gives its layers different expert "
                f"counts ({min(counts)} to {max(counts)}); vLLM builds every MoE "
                f"layer with num_experts ({text_config['num_experts']}), so "
                "layers pruned unevenly cannot be served"
            )


def language_model_fields(document: dict[str, Any], path: Path) -> dict[str, Any]:
    """The whole text config of a config document's language model, every
    field as the file has it, after checking that the MoE fields are valid and
    the attention and embedding fields (``LANGUAGE_MODEL_FIELDS``) are there."""
    text_config_fields(document, path)  # the MoE fields, validated
    text_config = document.get("text_config", document)
    where = "text_config" if "text_config" in document else "the top level"
    missing = [name for name in LANGUAGE_MODEL_FIELDS if text_config.get(name) is None]
    if missing:
        raise ConfigFileError(
            f"config file {path} lacks {', '.join(missing)} in {where}: plan "
            "needs Kimi-K3's attention fields to build the whole language model"
        )
    linear = text_config["linear_attn_config"]
    if not isinstance(linear, dict) or any(
        linear.get(name) is None for name in LINEAR_ATTENTION_FIELDS
    ):
        raise ConfigFileError(
            f"config file {path}: linear_attn_config must be an object with "
            f"{', '.join(LINEAR_ATTENTION_FIELDS)}"
        )
    _check_dsa_config(text_config.get("dsa_config"), path)
    return dict(text_config)


def _check_dsa_config(dsa_config: Any, path: Path) -> None:
    """A ``dsa_config`` (Kimi-K3.1's DSA layers, which vLLM 0.34 builds) is
    an object naming its layers, as vLLM's ``KimiLinearDSAConfig`` reads
    them: ``dsa_layers`` (or ``layers``), numbered from 1."""
    if dsa_config is None:
        return
    layers = (
        dsa_config.get("dsa_layers", dsa_config.get("layers"))
        if isinstance(dsa_config, dict)
        else None
    )
    if not isinstance(layers, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) for n in layers
    ):
        raise ConfigFileError(
            f"config file {path}: dsa_config must be an object with dsa_layers, "
            "a list of layer numbers"
        )


def declared_quantization_config(document: dict[str, Any]) -> Any:
    """The ``quantization_config`` a ``config.json`` document declares (at
    its top level, or its language model's), or None."""
    declared = document.get("quantization_config")
    nested = document.get("text_config")
    if declared is None and isinstance(nested, dict):
        declared = nested.get("quantization_config")
    return declared


def read_language_model_config(path: Path) -> dict[str, Any]:
    """The whole text config in a Hugging Face ``config.json`` (what ``plan``
    builds the language model from)."""
    return language_model_fields(read_config_document(path), path)
