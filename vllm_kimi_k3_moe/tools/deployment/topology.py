"""A Kimi-K3 deployment as ``vllm serve`` is asked for it, and what each GPU holds.

Plain Python (no torch, no vLLM), so ``check`` and the command line's input
validation run without paying for either import. The planner sizes a
``Deployment`` with vLLM's real layers; the checkpoint preflight splits the
checkpoint by its ``Topology``. Both name a topology here and refuse, with
the same line, what vLLM cannot build (``validate_topology``), so they
cannot disagree; which rows each GPU then loads is the format's
(``CheckpointFormat.rank_rows``).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, fields, replace
from typing import Any, Literal

from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.formats import FORMAT_NAMES, KimiK3Format, format_named
from vllm_kimi_k3_moe.tools.deployment.gpus import (
    AMD_PRESETS,
    amd_moe_backends,
    named_amd_arch,
)

# How a topology is named, by where the name appears (see Topology.label).
LabelStyle = Literal["short", "product", "sentence"]


class DeploymentError(ValueError):
    """A deployment that cannot be sized or checked; the message is one line."""


@dataclass(frozen=True)
class Topology:
    """How vLLM spreads Kimi-K3 over GPUs: PP pipeline stages, each holding
    a slice of the layers on TP x DP GPUs; within a stage each routed expert
    is sharded over all TP x DP GPUs, or (expert parallelism) whole experts
    are spread over them. Decode context parallelism (``dcp_size``) reuses
    the TP GPUs: it shards the MLA KV cache over groups of DCP of them and
    changes no weight."""

    tp_size: int
    _: KW_ONLY
    dp_size: int = 1
    expert_parallel: bool = False
    pp_size: int = 1
    dcp_size: int = 1

    @property
    def gpus(self) -> int:
        return self.tp_size * self.pp_size * self.dp_size

    @property
    def moe_group(self) -> int:
        """GPUs that share one MoE layer's experts: vLLM flattens TP and DP
        into the MoE's tensor- (or expert-) parallel group."""
        return self.tp_size * self.dp_size

    def label(self, style: LabelStyle = "short") -> str:
        """The topology's name; the only place one is built. Each style is
        what one output has always printed (the suite and README pin them):

        - ``short``: ``TP8 DP4 EP``; plan's table, progress and errors
        - ``product``: ``TP 8 x DP 1``; the GPU count in a split refusal
        - ``sentence``: ``TP8 x DP4 with expert parallelism``; check's share

        DCP, which adds no GPU, follows the TP size it splits in ``short``
        and ``sentence`` (``TP8 DCP8``, ``TP8 DCP8 x DP4 ...``).
        """
        tp, dp = f"TP{self.tp_size}", f"DP{self.dp_size}"
        if self.dcp_size > 1 and style != "product":
            tp = f"{tp} DCP{self.dcp_size}"
        if self.pp_size > 1:
            tp = f"{tp} PP{self.pp_size}" if style != "product" else tp
        if style == "short":
            parts = [tp]
            if self.dp_size > 1:
                parts.append(dp)
            if self.expert_parallel:
                parts.append("EP")
            return " ".join(parts)
        if style == "product":
            pp = f" x PP {self.pp_size}" if self.pp_size > 1 else ""
            return f"TP {self.tp_size}{pp} x DP {self.dp_size}"
        if style == "sentence":
            tp = tp.replace(" PP", " x PP")
            sizes = " x ".join([tp, *([dp] if self.dp_size > 1 else [])])
            how = "with" if self.expert_parallel else "without"
            return f"{sizes} {how} expert parallelism"
        raise ValueError(f"unknown label style {style!r}")

    def experts_per_gpu(self, num_experts: int) -> int:
        """Routed experts the heaviest GPU holds: GPU 0's slice under expert
        parallelism (``expert_ranges``), else all of them."""
        first, end = self.expert_ranges(num_experts)[0]
        return end - first

    def expert_ranges(self, num_experts: int) -> list[tuple[int, int]]:
        """The routed experts [first, end) each GPU of the MoE group holds.
        Under expert parallelism vLLM's linear placement
        (``determine_expert_map``): ``num_experts // group`` each, one more
        for the first ``num_experts % group`` GPUs, in order; so GPU 0 is
        the heaviest (``tests/upstream_contract`` holds this to vLLM's).
        Without it every GPU holds every expert."""
        group = self.moe_group
        if not self.expert_parallel:
            return [(0, num_experts)] * group
        base, extra = divmod(num_experts, group)
        ranges = []
        for gpu in range(group):
            first = gpu * base + min(gpu, extra)
            ranges.append((first, first + base + (gpu < extra)))
        return ranges

    def intermediate_per_gpu(self, intermediate: int) -> int:
        """Logical intermediate rows of each expert a GPU holds: all of them
        under expert parallelism, else its 1/(TP x DP) slice (GPU r: rows
        n*r to n*r+n-1), before any kernel padding."""
        if self.expert_parallel:
            return intermediate
        return intermediate // self.moe_group


@dataclass(frozen=True)
class Deployment(Topology):
    """What ``vllm serve`` would be asked for: the topology, the checkpoint's
    format (a ``vllm_kimi_k3_moe.formats`` name), the MoE kernel and, for a
    BF16 checkpoint quantized while vLLM loads it, the online method
    (``vllm serve --quantization NAME``, one of vLLM's online shorthands,
    or ``online``) and its ``--quantization-config`` (JSON), if any."""

    backend: str = "marlin"
    quantization: str = "mxfp4"
    online: str | None = None
    online_config: str | None = None

    @classmethod
    def of(
        cls,
        topology: Topology,
        backend: str,
        quantization: str,
        online: str | None = None,
        online_config: str | None = None,
    ) -> Deployment:
        """``topology`` served in ``quantization`` on ``backend`` (quantized
        while loading by ``online`` with ``--quantization-config
        online_config``, if given)."""
        sizes = {f.name: getattr(topology, f.name) for f in fields(Topology)}
        return cls(
            **sizes,
            backend=backend,
            quantization=quantization,
            online=online,
            online_config=online_config,
        )

    @property
    def format(self) -> KimiK3Format:
        return format_named(self.quantization)

    @property
    def topology(self) -> Topology:
        """The layout alone, without the format and kernel."""
        return Topology(**{f.name: getattr(self, f.name) for f in fields(Topology)})


def validate(text_config: dict[str, Any], deployment: Deployment) -> None:
    """Refuse, with one line naming the bad value, what cannot be sized."""
    validate_backend(deployment.quantization, deployment.backend, deployment.online)
    validate_topology(text_config, deployment)


def validate_backend(
    quantization: str, backend: str, online: str | None = None
) -> None:
    """Refuse a format or MoE backend the planner does not know. An online
    method's kernels are vLLM's to refuse when the layer is built (each
    method has its own: ``plan`` says vLLM's refusal)."""
    if quantization not in FORMAT_NAMES:
        raise DeploymentError(
            f"unknown quantization path {quantization!r}; "
            f"choose one of {', '.join(FORMAT_NAMES)}"
        )
    backends = format_named(quantization).moe_backends
    if named_amd_arch() is not None:  # on an AMD GPU: ROCm's kernels
        backends = amd_moe_backends(quantization)
    if backend == "auto":
        raise DeploymentError(
            "--moe-backend auto is resolved by vLLM from the GPU it starts on; "
            "name the kernel your deployment runs (vLLM logs it at startup), "
            "e.g. --moe-backend marlin"
        )
    if backend not in backends and online is None:
        on_rocm = named_amd_arch() is None and backend in amd_moe_backends(quantization)
        raise DeploymentError(
            f"unknown MoE backend {backend!r} for {quantization}; "
            f"choose one of {', '.join(backends)}"
            + (
                f" ({backend} is a ROCm backend: name the AMD GPU, --gpu "
                f"{', '.join(AMD_PRESETS)})"
                if on_rocm
                else ""
            )
        )


# vLLM pads the vocabulary to a multiple of this before splitting it over TP
# (``vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE``).
VOCAB_PADDING = 64


def validate_topology(text_config: dict[str, Any], topology: Topology) -> None:
    """Refuse, in one line naming the value and the rule, a topology vLLM
    0.33.0 cannot build for this model and format, before any build. The
    rules, each as vLLM applies it (``tests/upstream_contract`` holds vLLM to
    them): whole attention heads per TP rank (MLA and KDA), whole vocabulary
    rows per TP rank, at least one layer per pipeline stage, and the routed
    experts split over each stage's TP x DP GPUs: under expert parallelism
    whole experts, as evenly as they go (``expert_ranges``: vLLM gives the
    first GPUs one more where the count does not divide, as a pruned
    checkpoint's 806 over 8; only MegaMoE and EPLB, which plan does not
    size, need an even split), else every expert's intermediate rows evenly
    (``FusedMoEConfig``). Where an even slice splits the format's scale
    groups, the plugin gives each GPU whole groups instead
    (``CheckpointFormat.rank_rows``); every GPU of a stage allocates what
    its rank 0 does."""
    sizes = {"tensor": topology.tp_size, "data": topology.dp_size}
    sizes["pipeline"] = topology.pp_size
    sizes["decode-context"] = topology.dcp_size
    for kind, size in sizes.items():
        if size < 1:
            raise DeploymentError(
                f"{kind}-parallel size must be at least 1, got {size} "
                f"({topology.label('product')})"
            )
    # and DCP within the TP GPUs, as vLLM's ParallelConfig requires
    validate_decode_context_split(topology.tp_size, topology.dcp_size)
    validate_attention_split(text_config, topology.tp_size)
    vocab = text_config.get("vocab_size")
    if isinstance(vocab, int):
        padded = -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
        if padded % topology.tp_size:
            raise DeploymentError(
                f"TP {topology.tp_size} does not divide Kimi-K3's vocabulary "
                f"of {padded}: vLLM gives every rank the same rows of the "
                "embeddings and lm_head"
            )
    layers = text_config["num_hidden_layers"]
    if topology.pp_size > layers:
        raise DeploymentError(
            f"pipeline-parallel size {topology.pp_size} exceeds the "
            f"{layers} layers; vLLM gives every stage at least one layer"
        )
    group, product = topology.moe_group, topology.label("product")
    if topology.expert_parallel:
        return
    intermediate = text_config["moe_intermediate_size"]
    if intermediate % group:
        raise DeploymentError(
            f"moe_intermediate_size {intermediate} does not split evenly over "
            f"{group} GPUs ({product}); without expert parallelism vLLM "
            "shards every expert over all of them"
        )


def layouts(gpus: int, text_config: dict[str, Any]) -> list[Topology]:
    """Every topology of exactly ``gpus`` GPUs that ``validate_topology``
    lets through: TP x PP x DP, each with and without expert parallelism
    (which needs more than one GPU per stage), each with every
    decode-context-parallel size vLLM takes (``with_each_dcp_size``)."""
    found = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            for ep in (False, True):
                topology = Topology(tp, dp_size=dp, pp_size=pp, expert_parallel=ep)
                if ep and topology.moe_group == 1:
                    continue
                try:
                    validate_topology(text_config, topology)
                except DeploymentError:
                    continue
                found.append(topology)
    return with_each_dcp_size(found)


def with_each_dcp_size(topologies: list[Topology]) -> list[Topology]:
    """Each topology without DCP and with every DCP size dividing its TP
    (``validate_decode_context_split``'s rule; DCP changes nothing else a
    rule reads)."""
    return [
        replace(topology, dcp_size=dcp)
        for topology in topologies
        for dcp in _divisors(topology.tp_size)
    ]


def pipeline_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """The decoder layers [start, end) of each pipeline stage, as vLLM's
    ``get_pp_indices`` splits them by default (``VLLM_PP_LAYER_PARTITION``
    unset): evenly, the remainder one layer each to the stages before the
    last (``tests/upstream_contract`` holds it to vLLM's)."""
    sizes = [num_layers // pp_size] * pp_size
    for stage in range(num_layers % pp_size):
        sizes[-2 - stage] += 1
    starts = [sum(sizes[:stage]) for stage in range(pp_size)]
    return [(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# vLLM's --kv-cache-dtype values the planner sizes: the model's dtype (bf16)
# or FP8 (one byte per element of the MLA latent cache).
KV_CACHE_DTYPES = ("auto", "fp8")
# Without --max-model-len: the context length plan assumes (Kimi-K3's
# published text_config leaves it to max_position_embeddings, which vLLM
# takes as the default when set).
DEFAULT_MAX_MODEL_LEN = 131072


@dataclass(frozen=True)
class Serving:
    """How ``vllm serve`` is asked to hold the KV cache, and whether it
    loads the vision tower (``--language-model-only``: not)."""

    kv_cache_dtype: str = "auto"
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    language_model_only: bool = False


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


def validate_decode_context_split(tp_size: int, dcp_size: int) -> None:
    """Refuse a decode-context-parallel size that does not divide the TP
    size: without prefill context parallelism vLLM's DCP groups are made of
    TP GPUs (``ParallelConfig``'s validator: "tp_size must be divisible by
    dcp_size")."""
    if tp_size % dcp_size:
        raise DeploymentError(
            f"decode-context-parallel size {dcp_size} does not divide "
            f"tensor-parallel size {tp_size}; vLLM makes each DCP group of "
            "the TP GPUs (tp_size must be divisible by dcp_size)"
        )


# Why vLLM 0.33.0 cannot build Kimi-K3 with --prefill-context-parallel-size
# above 1: the assertion of its NVIDIA MultiHeadLatentAttention
# (vllm/models/kimi_k3/nvidia/mla.py), quoted.
KIMI_K3_PCP_REFUSAL = (
    "Kimi-K3 MultiHeadLatentAttention does not support prefill context parallelism."
)


def validate_prefill_context_parallel(pcp_size: int) -> None:
    """Refuse prefill context parallelism, which vLLM 0.33.0's Kimi-K3
    attention asserts away when it is built (``KIMI_K3_PCP_REFUSAL``)."""
    if pcp_size < 1:
        raise DeploymentError(
            f"prefill-context-parallel size must be at least 1, got {pcp_size}"
        )
    if pcp_size > 1:
        raise DeploymentError(
            f"prefill-context-parallel size {pcp_size}: {VLLM} does not "
            "build Kimi-K3 with it (its NVIDIA MLA layer asserts "
            f'"{KIMI_K3_PCP_REFUSAL}"); use 1, or DCP for the KV cache'
        )
