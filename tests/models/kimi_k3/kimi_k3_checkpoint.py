"""A tiny checkpoint in Kimi-K3's released format, written to a directory.

Laid out like the published Kimi-K3 weights: a multimodal ``config.json``
(``model_type`` kimi_k3, the language model under ``text_config``, a
compressed-tensors ``mxfp4-pack-quantized`` ``quantization_config``) and
safetensors shards with a ``model.safetensors.index.json``. Routed experts are
named as vLLM's Kimi-K3 loader reads them,
``language_model.layers.{layer}.block_sparse_moe.experts.{expert}.{w1|w2|w3}.
{weight_packed|weight_scale}``: uint8, the input dimension packed two FP4
values per byte with one E8M0 scale byte per 32 values. Their bytes are seeded
per tensor and never zero, so a byte that lands in the wrong place, or a
padded tail that is never written, shows.

The widths are small and the expert count is 8, but ``moe_intermediate_size``
is Kimi-K3's 3072, so TP32 still splits it into 96 rows per rank.
``KimiK3Spec.released()`` with ``write_header_only_checkpoint`` gives the
release-sized header set (no data) that ``benchmarks/check_time.py`` times.

The routed-expert names are the ones the end-to-end test proves vLLM maps. The
``quantization_config`` targets and ignore list, and the few non-expert
tensors, are modelled on published compressed-tensors checkpoints, not copied
from Kimi-K3's; nothing here depends on them.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.models.kimi_k3.mxfp4_checkpoint import logical_shape
from vllm_kimi_k3_moe.formats.mxfp4 import WEIGHTS as MXFP4_WEIGHT_ARGS
from vllm_kimi_k3_moe.tools.deployment.text_config import (
    KIMI_K3_ATTENTION_FIELDS,
    KIMI_K3_MOE_FIELDS,
)

PREFIX = "language_model.layers"
PROJECTIONS = ("w1", "w3", "w2")  # gate, up, down
SUFFIXES = ("weight_packed", "weight_scale")

# The compressed-tensors block of an MXFP4 pack-quantized release: FP4 weights
# in groups of 32 for the routed experts, everything else left in bf16.
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                **MXFP4_WEIGHT_ARGS,
                "scale_dtype": "torch.uint8",
                "zp_dtype": "torch.uint8",
                "observer": "minmax",
                "actorder": None,
                "block_structure": None,
            },
            "input_activations": None,
            "output_activations": None,
            "format": "mxfp4-pack-quantized",
        }
    },
    "ignore": [
        "lm_head",
        r"re:.*self_attn.*",
        r"re:.*shared_experts.*",
        r"re:.*block_sparse_moe\.gate$",
        r"re:.*routed_expert_(up|down)_proj.*",
        r"re:.*mlp\.(gate|up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
}


@dataclass(frozen=True)
class KimiK3Spec:
    """The dimensions of a generated checkpoint: tiny by default."""

    hidden_size: int = 512
    routed_expert_hidden_size: int = 256  # what the experts see
    moe_intermediate_size: int = 3072
    num_experts: int = 8
    num_experts_per_token: int = 2
    num_hidden_layers: int = 3  # layer 0 dense, layers 1 and 2 MoE
    num_nextn_predict_layers: int = 1  # layer 3: the MTP block, also MoE
    first_k_dense_replace: int = 1
    vocab_size: int = 1024
    # MLA heads; vLLM's config checks want them to split over TP32
    num_attention_heads: int = 64
    shards: int = 3

    @classmethod
    def released(cls) -> KimiK3Spec:
        """Kimi-K3's published dimensions, for header-only checkpoints."""
        return cls(
            hidden_size=7168,
            routed_expert_hidden_size=3584,
            num_experts=896,
            num_experts_per_token=16,
            num_hidden_layers=93,
            num_nextn_predict_layers=0,
            vocab_size=163840,
            num_attention_heads=96,  # as published: TP24 is refused by the vocabulary
            shards=96,
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        last = self.num_hidden_layers + self.num_nextn_predict_layers
        return tuple(range(self.first_k_dense_replace, last))

    @property
    def main_moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in self.moe_layers if i < self.num_hidden_layers)

    def text_config(self) -> dict:
        return {
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            **KIMI_K3_MOE_FIELDS,  # routing and activation as released
            "hidden_size": self.hidden_size,
            "routed_expert_hidden_size": self.routed_expert_hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_token,
            "num_shared_experts": 1,
            "num_hidden_layers": self.num_hidden_layers,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "first_k_dense_replace": self.first_k_dense_replace,
            "intermediate_size": 1024,
            # Kimi-K3's attention (what building the language model needs),
            # the last layer MLA and the others KDA
            **KIMI_K3_ATTENTION_FIELDS,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "head_dim": 128,
            "linear_attn_config": {
                **KIMI_K3_ATTENTION_FIELDS["linear_attn_config"],
                "full_attn_layers": [self.num_hidden_layers],
                "kda_layers": list(range(1, self.num_hidden_layers)),
            }
            if self.num_hidden_layers != 93
            else KIMI_K3_ATTENTION_FIELDS["linear_attn_config"],
            "vocab_size": self.vocab_size,
            "max_position_embeddings": 4096,
            "torch_dtype": "bfloat16",
        }

    def config(self) -> dict:
        return {
            "model_type": "kimi_k3",
            "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": self.text_config(),
            "vision_config": {"model_type": "kimi_k3_vision"},
            "quantization_config": QUANTIZATION_CONFIG,
            "torch_dtype": "bfloat16",
        }


def expert_tensor_name(layer: int, expert: int, projection: str, suffix: str) -> str:
    return f"{PREFIX}.{layer}.block_sparse_moe.experts.{expert}.{projection}.{suffix}"


def expert_tensor_shape(
    spec: KimiK3Spec, projection: str, suffix: str
) -> tuple[int, int]:
    return logical_shape(
        projection,
        "weight" if suffix == "weight_packed" else suffix,
        spec.routed_expert_hidden_size,
        spec.moe_intermediate_size,
    )


def expert_tensors(spec: KimiK3Spec) -> Iterator[tuple[str, tuple[int, int]]]:
    """(name, shape) of every routed-expert tensor, layer by layer."""
    for layer in spec.moe_layers:
        for expert in range(spec.num_experts):
            for projection in PROJECTIONS:
                for suffix in SUFFIXES:
                    yield (
                        expert_tensor_name(layer, expert, projection, suffix),
                        expert_tensor_shape(spec, projection, suffix),
                    )


def other_tensors(spec: KimiK3Spec) -> dict[str, tuple[int, ...]]:
    """bf16 tensors that are not routed experts, which the preflight skips."""
    hidden = spec.hidden_size
    shapes = {
        "language_model.model.embed_tokens.weight": (spec.vocab_size, hidden),
        "language_model.lm_head.weight": (spec.vocab_size, hidden),
        "vision_tower.patch_embed.proj.weight": (64, 3, 14, 14),
    }
    for layer in range(spec.num_hidden_layers + spec.num_nextn_predict_layers):
        block = f"{PREFIX}.{layer}"
        shapes[f"{block}.input_layernorm.weight"] = (hidden,)
        shapes[f"{block}.self_attn.o_proj.weight"] = (hidden, 64 * 128)
        if layer not in spec.moe_layers:
            shapes[f"{block}.mlp.gate_proj.weight"] = (1024, hidden)
            continue
        moe = f"{block}.block_sparse_moe"
        shapes[f"{moe}.gate.weight"] = (spec.num_experts, hidden)
        shapes[f"{moe}.shared_experts.gate_proj.weight"] = (3072, hidden)
        # the latent adapters, [output, input]: down to the experts' width
        # and back up (BF16: the suite's configs leave them unquantized)
        shapes[f"{moe}.routed_expert_down_proj.weight"] = (
            spec.routed_expert_hidden_size,
            hidden,
        )
        shapes[f"{moe}.routed_expert_up_proj.weight"] = (
            hidden,
            spec.routed_expert_hidden_size,
        )
    return shapes


def nonzero_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, shape, generator=generator, dtype=torch.uint8)


def checkpoint_tensors(spec: KimiK3Spec) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint; expert bytes seeded by their position."""
    tensors = {
        name: nonzero_bytes(shape, seed)
        for seed, (name, shape) in enumerate(expert_tensors(spec))
    }
    for name, shape in other_tensors(spec).items():
        tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
    return tensors


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def split_into_shards(tensors: dict[str, torch.Tensor], count: int) -> list[dict]:
    """Consecutive runs of ``tensors``, one dict per shard."""
    names = list(tensors)
    per_shard = -(-len(names) // count)
    return [
        {name: tensors[name] for name in names[i * per_shard : (i + 1) * per_shard]}
        for i in range(count)
    ]


def _write_config_and_index(
    directory: Path, config: dict, weight_map: dict[str, str], total: int
) -> None:
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def write_checkpoint(
    directory: Path,
    spec: KimiK3Spec | None = None,
    shards: list[dict[str, torch.Tensor]] | None = None,
    config: dict | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Write ``config.json``, the shards and the index to ``directory``, and
    return the shards' tensors. ``shards`` replaces the generated tensors
    (corruption tests edit them); a name in two shards is indexed to the last.
    ``config`` replaces the generated ``config.json``."""
    spec = spec or KimiK3Spec()
    if shards is None:
        shards = split_into_shards(checkpoint_tensors(spec), spec.shards)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for index, tensors in enumerate(shards):
        name = shard_name(index, len(shards))
        save_file(tensors, directory / name, {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    _write_config_and_index(directory, config or spec.config(), weight_map, total)
    return shards


DTYPE_BYTES = {"U8": 1, "F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}
HeaderEntry = tuple[str, str, tuple[int, ...]]  # (name, dtype, shape)


def write_header_only_checkpoint(directory: Path, spec: KimiK3Spec) -> int:
    """Write ``spec``'s checkpoint with real shard headers but no tensor data:
    each shard is a sparse file of its full size (its data reads as zeros and
    takes no disk). Returns the number of tensors."""
    entries = [(name, "U8", shape) for name, shape in expert_tensors(spec)]
    entries += [(name, "BF16", shape) for name, shape in other_tensors(spec).items()]
    write_headers(directory, spec, entries, spec.config())
    return len(entries)


def write_headers(
    directory: Path, spec: KimiK3Spec, entries: list[HeaderEntry], config: dict
) -> None:
    """Shards holding ``entries`` (headers only, sparse data), their index,
    and ``config`` as ``config.json``."""
    per_shard = -(-len(entries) // spec.shards)
    weight_map: dict[str, str] = {}
    total = 0
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(spec.shards):
        name = shard_name(index, spec.shards)
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tensor, dtype, shape in entries[
            index * per_shard : (index + 1) * per_shard
        ]:
            size = DTYPE_BYTES[dtype] * math.prod(shape)
            header[tensor] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
            weight_map[tensor] = name
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
        with (directory / name).open("wb") as shard:
            shard.write(struct.pack("<Q", len(text)) + text)
            shard.truncate(8 + len(text) + offset)
        total += offset
    _write_config_and_index(directory, config, weight_map, total)
