"""A Kimi-K3 deployment as ``vllm serve`` is asked for it, and what each GPU holds.

Plain Python (no torch, no vLLM), so ``check`` and the command line's input
validation run without paying for either import. The planner sizes a
``Deployment`` with vLLM's real layers; the checkpoint preflight splits the
checkpoint by its ``Topology``. Both name a topology, refuse an uneven split
and compute each GPU's share here, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal

from vllm_kimi_k3_moe.formats import FORMAT_NAMES, KimiK3Format, format_named

# How a topology is named, by where the name appears (see Topology.label).
LabelStyle = Literal["short", "subject", "product", "sentence"]


class DeploymentError(ValueError):
    """A deployment that cannot be sized or checked; the message is one line."""


@dataclass(frozen=True)
class Topology:
    """How vLLM spreads Kimi-K3 over GPUs: TP x DP GPUs, each routed expert
    sharded over all of them, or (expert parallelism) whole experts each."""

    tp_size: int
    _: KW_ONLY
    dp_size: int = 1
    expert_parallel: bool = False

    @property
    def gpus(self) -> int:
        return self.tp_size * self.dp_size

    def label(self, style: LabelStyle = "short") -> str:
        """The topology's name; the only place one is built. Each style is
        what one output has always printed (the suite and README pin them):

        - ``short``: ``TP8 DP4 EP``; plan's table, progress and errors
        - ``subject``: ``TP8 DP1``; a topology problem in check's list
        - ``product``: ``TP 8 x DP 1``; the GPU count in a split refusal
        - ``sentence``: ``TP8 x DP4 with expert parallelism``; check's share
        """
        tp, dp = f"TP{self.tp_size}", f"DP{self.dp_size}"
        if style == "short":
            parts = [tp]
            if self.dp_size > 1:
                parts.append(dp)
            if self.expert_parallel:
                parts.append("EP")
            return " ".join(parts)
        if style == "subject":
            return f"{tp} {dp}"
        if style == "product":
            return f"TP {self.tp_size} x DP {self.dp_size}"
        if style == "sentence":
            sizes = f"{tp} x {dp}" if self.dp_size > 1 else tp
            how = "with" if self.expert_parallel else "without"
            return f"{sizes} {how} expert parallelism"
        raise ValueError(f"unknown label style {style!r}")

    def experts_per_gpu(self, num_experts: int) -> int:
        """Routed experts each GPU holds: its own slice under expert
        parallelism (GPU r: experts n*r to n*r+n-1), else all of them."""
        return num_experts // self.gpus if self.expert_parallel else num_experts

    def intermediate_per_gpu(self, intermediate: int) -> int:
        """Logical intermediate rows of each expert a GPU holds: all of them
        under expert parallelism, else its 1/(TP x DP) slice (GPU r: rows
        n*r to n*r+n-1), before any kernel padding."""
        return intermediate if self.expert_parallel else intermediate // self.gpus


@dataclass(frozen=True)
class Deployment(Topology):
    """What ``vllm serve`` would be asked for: the topology, the checkpoint's
    format (a ``vllm_kimi_k3_moe.formats`` name) and the MoE kernel."""

    backend: str = "marlin"
    quantization: str = "mxfp4"

    @property
    def format(self) -> KimiK3Format:
        return format_named(self.quantization)


def validate(text_config: dict[str, Any], deployment: Deployment) -> None:
    """Refuse, with one line naming the bad value, what cannot be sized."""
    if deployment.tp_size < 1 or deployment.dp_size < 1:
        raise DeploymentError(
            f"tensor- and data-parallel sizes must be at least 1, got "
            f"TP {deployment.tp_size} and DP {deployment.dp_size}"
        )
    validate_backend(deployment.quantization, deployment.backend)
    validate_topology(text_config, deployment, deployment.format)
    validate_attention_split(text_config, deployment.tp_size)


def validate_backend(quantization: str, backend: str) -> None:
    """Refuse a format or MoE backend the planner does not know."""
    if quantization not in FORMAT_NAMES:
        raise DeploymentError(
            f"unknown quantization path {quantization!r}; "
            f"choose one of {', '.join(FORMAT_NAMES)}"
        )
    backends = format_named(quantization).moe_backends
    if backend == "auto":
        raise DeploymentError(
            "--moe-backend auto is resolved by vLLM from the GPU it starts on; "
            "name the kernel your deployment runs (vLLM logs it at startup), "
            "e.g. --moe-backend marlin"
        )
    if backend not in backends:
        raise DeploymentError(
            f"unknown MoE backend {backend!r} for {quantization}; "
            f"choose one of {', '.join(backends)}"
        )


def validate_topology(
    text_config: dict[str, Any], topology: Topology, fmt: KimiK3Format
) -> None:
    """Refuse a topology that does not split the routed experts evenly: the
    experts over the expert-parallel GPUs, or else every expert's
    intermediate size over all GPUs in whole scale groups of the format
    (``fmt.alignment`` values: each GPU's scales are its own). Even splits
    are what let rank 0 stand for every GPU."""
    gpus, product = topology.gpus, topology.label("product")
    if topology.expert_parallel:
        experts = text_config["num_experts"]
        if experts % gpus:
            raise DeploymentError(
                f"{experts} routed experts do not split evenly over {gpus} "
                f"expert-parallel GPUs ({product})"
            )
        return
    intermediate = text_config["moe_intermediate_size"]
    if intermediate % (gpus * fmt.alignment):
        whole = (
            f" in whole {fmt.alignment_unit} of {fmt.alignment} values"
            if fmt.alignment > 1
            else ""
        )
        raise DeploymentError(
            f"moe_intermediate_size {intermediate} does not split evenly over "
            f"{gpus} GPUs ({product}){whole}; without expert parallelism vLLM "
            "shards every expert over all of them"
        )


# vLLM's --kv-cache-dtype values the planner sizes: the model's dtype (bf16)
# or FP8 (one byte per element of the MLA latent cache).
KV_CACHE_DTYPES = ("auto", "fp8")
# Without --max-model-len: the context length plan assumes (Kimi-K3's
# published text_config leaves it to max_position_embeddings, which vLLM
# takes as the default when set).
DEFAULT_MAX_MODEL_LEN = 131072


@dataclass(frozen=True)
class Serving:
    """How ``vllm serve`` is asked to hold the KV cache."""

    kv_cache_dtype: str = "auto"
    max_model_len: int = DEFAULT_MAX_MODEL_LEN


def validate_serving(serving: Serving) -> None:
    if serving.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise DeploymentError(
            f"unknown --kv-cache-dtype {serving.kv_cache_dtype!r}; "
            f"choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    if serving.max_model_len < 1:
        raise DeploymentError(
            f"--max-model-len must be a positive number of tokens, got "
            f"{serving.max_model_len}"
        )


def validate_attention_split(text_config: dict[str, Any], tp_size: int) -> None:
    """Refuse a tensor-parallel size that does not divide the MLA or the KDA
    heads: vLLM gives every rank the same number of whole heads."""
    heads = {
        "num_attention_heads": text_config.get("num_attention_heads"),
        "linear_attn_config.num_heads": (
            text_config.get("linear_attn_config") or {}
        ).get("num_heads"),
    }
    for name, count in heads.items():
        if isinstance(count, int) and count % tp_size:
            raise DeploymentError(
                f"{name} {count} does not split evenly over tensor-parallel "
                f"size {tp_size}; vLLM gives every rank the same whole heads"
            )
