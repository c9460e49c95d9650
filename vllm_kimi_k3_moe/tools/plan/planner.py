"""Size Kimi-K3 deployments per GPU by building vLLM's model for rank 0.

For a deployment (TP, PP, DP, expert parallelism, published format and MoE
kernel) the ``Planner`` builds vLLM 0.33.0's whole Kimi-K3 language model for
rank 0 on the ``meta`` device twice, as upstream builds it and with this
plugin (``tools.meta_rank.whole_model``), without pipeline parallelism: each
pipeline stage's share is summed from the per-layer sizes of that build, the
layers split as vLLM splits them (``get_pp_indices``; embeddings on the first
stage, ``lm_head`` on the last). The KV cache of each stage comes from the
specs of the attention layers it holds, sized together by vLLM's own planner
(``tools.meta_rank.kv_cache``). A build is made once per distinct sharding (the
whole model per TP; its MLPs per MoE group, TP x DP, and expert
parallelism) and reused by every layout that shares it.
``topology.validate`` refuses, before any build, what vLLM cannot build, so
every GPU of a stage allocates what its rank 0 does.
On an AMD GPU (``plan --gpu mi300x``: ``gpus.an_amd_gpu_named`` held) the
model is vLLM's AMD one, its MoE layers vLLM's AMD ``KimiMoE``
(``vllm/models/kimi_k3/amd/linear.py``), upstream's and the plugin's, built
under ROCm's platform on that GPU's architecture (``whole_model``; on an
Intel GPU its hybrid build); vLLM alone's raises at every tensor-parallel
size of 16 or more, which makes the layout one vLLM alone cannot build,
with its error and what it means (``AMD_PADDING_RAISES``). A DCP size is
planned on ROCm where vLLM's ROCm attention selector takes it
(``KvCachePlanner.with_decode_context``), else refused with its reason.
"""

from __future__ import annotations

import importlib
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import vllm_kimi_k3_moe
from vllm_kimi_k3_moe.compat import VLLM
from vllm_kimi_k3_moe.formats import KimiK3Format
from vllm_kimi_k3_moe.patching import upstream_class
from vllm_kimi_k3_moe.tools.deployment.gpu_budget import GpuBudget
from vllm_kimi_k3_moe.tools.deployment.gpus import (
    named_amd_arch,
    serving_environment,
)
from vllm_kimi_k3_moe.tools.deployment.kv_budget import KvBudget, kv_budget
from vllm_kimi_k3_moe.tools.deployment.nodes import DEFAULT_GPUS_PER_NODE, node_split
from vllm_kimi_k3_moe.tools.deployment.speculation import Speculation
from vllm_kimi_k3_moe.tools.deployment.text_config import (
    moe_layer_count,
    one_layer_of_each,
)
from vllm_kimi_k3_moe.tools.deployment.topology import (
    Deployment,
    DeploymentError,
    Serving,
    layouts,
    validate,
    validate_serving,
)
from vllm_kimi_k3_moe.tools.meta_rank.allocation import (
    LayerAllocation,
    PlacedAllocation,
)
from vllm_kimi_k3_moe.tools.meta_rank.draft import for_vllm, write_draft_dir
from vllm_kimi_k3_moe.tools.meta_rank.kv_cache import (
    DecodeContextRefused,
    KvCachePlanner,
)
from vllm_kimi_k3_moe.tools.meta_rank.vllm_config import write_model_dir
from vllm_kimi_k3_moe.tools.meta_rank.whole_model import (
    BUILD_ERRORS,
    amd_kimi_moe_module,
    build_rank,
)
from vllm_kimi_k3_moe.tools.plan.serve_command import DEFAULT_MODEL, serve_commands
from vllm_kimi_k3_moe.tools.plan.values import (
    DeploymentPlan,
    MoeMemoryPlan,
    StageAllocation,
)

# What vLLM raises when it cannot build a layer for a deployment
# (``whole_model.BUILD_ERRORS``), and what vLLM alone's AMD KimiMoE raises
# at every tensor-parallel size of 16 or more (it reads ``w13_weight_packed``
# off its MoE runner, which has none): vLLM alone's build only; the plugin's
# raising it is a bug, not a refusal.
UPSTREAM_BUILD_ERRORS = (*BUILD_ERRORS, AttributeError)
# What that error is, said after it
AMD_PADDING_RAISES = (
    " (vLLM's AMD KimiMoE, vllm/models/kimi_k3/amd/linear.py, pads each GPU's "
    "experts to 256 rows at model level where 3072 / TP < 256, TP16 and up, "
    "with or without EP or DP, then reads w13_weight_packed off its MoE "
    "runner, which has none)"
)


class PlanError(ValueError):
    """vLLM cannot build a deployment that passed ``validate``, or the plugin
    did not patch it; the message is one line."""


class BuildRefused(PlanError):
    """vLLM refuses to build ``deployment`` (the message says why)."""

    def __init__(self, message: str, deployment: Deployment) -> None:
        super().__init__(message)
        self.deployment = deployment


def kimi_moe_classes() -> tuple[type, type]:
    """(upstream ``KimiMoE``, patched ``KimiMoE``), importing vLLM's model:
    the NVIDIA model's, or with an AMD GPU named (``gpus.an_amd_gpu_named``)
    the AMD model's (``vllm/models/kimi_k3/amd/linear.py``)."""
    vllm_kimi_k3_moe.register()
    if named_amd_arch() is not None:
        model = amd_kimi_moe_module()
    else:
        model = importlib.import_module(vllm_kimi_k3_moe.KIMI_K3_NVIDIA_MODEL)
    upstream = upstream_class(model.KimiMoE)
    if model.KimiMoE is upstream:
        raise PlanError(
            "the plugin did not patch vLLM's Kimi-K3 model (see the warning "
            f"above): the planner needs {VLLM} on a non-ROCm platform"
        )
    return upstream, model.KimiMoE


def pipeline_stages(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """The decoder layers [start, end) of each stage, as vLLM splits them."""
    from vllm.distributed.utils import get_pp_indices

    return [get_pp_indices(num_layers, rank, pp_size) for rank in range(pp_size)]


@dataclass(frozen=True)
class _Built:
    """One sharding's rank 0, upstream and fixed, and its KV-cache specs;
    upstream None (and why) where vLLM alone cannot build it."""

    upstream: PlacedAllocation | None
    fixed: PlacedAllocation
    upstream_moe: LayerAllocation | None
    fixed_moe: LayerAllocation
    kv: KvCachePlanner
    upstream_refusal: str | None = None


def kept_by_its_kernel(upstream: Any, fixed: Any) -> Any:
    """vLLM alone's build as its kernel keeps it: where that kernel's weight
    preparation pads vLLM alone's partition again (the plugin's record of
    the layer says to how many rows), its routed experts hold that many
    rows from then on, as the plugin's own build (same kernel, another
    partition) and vLLM alone's give them."""
    rows = fixed.moe_layer.vllm_alone_resident
    if rows is None:
        return upstream
    layer = upstream.moe_layer.kept_by_its_kernel(rows, fixed.moe_layer)
    placed = upstream.placed.with_routed_bytes(layer.routed_bytes)
    return replace(upstream, placed=placed, moe_layer=layer)


class Planner:
    """Sizes deployments of one text config under one serving setup and GPU
    budget, building each distinct sharding once."""

    def __init__(
        self,
        text_config: dict[str, Any],
        serving: Serving | None = None,
        budget: GpuBudget | None = None,
        model: str = DEFAULT_MODEL,
        quantization_config: dict[str, Any] | None = None,
        gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
        speculation: Speculation | None = None,
    ) -> None:
        self.text_config = text_config
        # a checkpoint's own quantization_config (any config vLLM accepts of
        # the deployments' format); None: the format's published one
        self.quantization_config = quantization_config
        self.serving = serving or Serving()
        validate_serving(self.serving)
        self.budget = budget
        # budget as the installed vLLM shares it out, made once from the
        # first rank's config (every layout's CacheConfig is the same)
        self._kv_budgets: dict[GpuBudget, KvBudget] = {}
        self.model = model
        self.gpus_per_node = gpus_per_node
        self.speculation = speculation
        self.upstream_cls, self.fixed_cls = kimi_moe_classes()
        self._directory = tempfile.TemporaryDirectory(prefix="kimi-k3-config-")
        # what vLLM is given of --speculative-config: its draft's config.json
        # in a directory of its own
        self._speculative = speculation and for_vllm(
            speculation,
            write_draft_dir(speculation, Path(self._directory.name) / "draft"),
        )
        self._model_dirs: dict[tuple[str, bool], Path] = {}
        # keyed by a deployment's sharding: the deployment without its pipeline
        # stages, which change which layers a GPU holds, not how they are split
        self._builds: dict[Deployment, _Built] = {}

    def close(self) -> None:
        self._directory.cleanup()

    def __enter__(self) -> Planner:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _model_dir(
        self, fmt: KimiK3Format, text_config: dict[str, Any], serving: Serving
    ) -> Path:
        key = (fmt.name, text_config is self.text_config)
        if key not in self._model_dirs:
            directory = (
                Path(self._directory.name) / f"{fmt.name}-{len(self._model_dirs)}"
            )
            directory.mkdir()
            config = self.quantization_config or fmt.published_quantization_config()
            self._model_dirs[key] = write_model_dir(
                text_config, config, serving, directory
            )
        return self._model_dirs[key]

    def _build(self, deployment: Deployment, text_config: dict[str, Any]) -> Any:
        """(upstream, fixed, why upstream failed) ``RankBuild`` of
        ``deployment``'s rank 0, one pipeline stage holding every layer of
        ``text_config``; upstream None where vLLM alone cannot build it, a
        ``PlanError`` where the plugin cannot either."""
        serving = self.serving
        if text_config is not self.text_config:  # an MoE layer alone
            serving = replace(serving, language_model_only=True)
            if self.speculation is not None and self.speculation.method == "mtp":
                # the MTP draft's MoE layer is sharded as the others
                text_config = {
                    **text_config,
                    "num_nextn_predict_layers": self.text_config[
                        "num_nextn_predict_layers"
                    ],
                }
        model_dir = self._model_dir(deployment.format, text_config, serving)
        built: list[Any] = []
        # on an AMD GPU named: vLLM's AMD KimiMoE, upstream's and the plugin's
        classes = (
            kimi_moe_classes()
            if named_amd_arch() is not None
            else (self.upstream_cls, self.fixed_cls)
        )
        for cls in classes:
            errors = BUILD_ERRORS if cls is classes[1] else UPSTREAM_BUILD_ERRORS
            try:
                built.append(
                    build_rank(
                        cls,
                        text_config,
                        deployment,
                        serving,
                        model_dir,
                        gpus_per_node=self.gpus_per_node,
                        speculative=self._speculative,
                    )
                )
            except errors as error:
                why = f"{type(error).__name__}: {error}".replace("\n", " ")
                if isinstance(error, AttributeError):  # vLLM alone's AMD KimiMoE
                    why += AMD_PADDING_RAISES
                if cls is classes[1]:
                    raise BuildRefused(
                        f"{VLLM} cannot build Kimi-K3 for {deployment.label()} in "
                        f"{deployment.online or deployment.quantization} on "
                        f"{deployment.backend}: {why}",
                        deployment,
                    ) from error
                built.append(why)
        upstream, fixed = built
        if isinstance(upstream, str):
            return None, fixed, upstream
        return kept_by_its_kernel(upstream, fixed), fixed, None

    def _built(self, deployment: Deployment) -> _Built:
        """The sharding of ``deployment``, built once: the whole model for its
        TP; with DP (whose MoE group is TP x DP) or expert parallelism, the
        MLPs alone under that sharding, in a two-layer model (a dense layer
        and an MoE layer; attention, embeddings and norms depend on TP
        alone). Decode context parallelism changes no parameter and no
        KV-cache spec (a test builds it), only how vLLM's planner sizes the
        cache: it is not part of the sharding."""
        sharding = replace(deployment, pp_size=1, dcp_size=1)
        if sharding in self._builds:
            return self._builds[sharding]
        whole_sharding = replace(sharding, dp_size=1, expert_parallel=False)
        if whole_sharding not in self._builds:
            upstream, fixed, why = self._build(whole_sharding, self.text_config)
            self._builds[whole_sharding] = _Built(
                upstream and upstream.placed,
                fixed.placed,
                upstream and upstream.moe_layer,
                fixed.moe_layer,
                KvCachePlanner(fixed.vllm_config),
                why,
            )
        whole = self._builds[whole_sharding]
        if sharding != whole_sharding:
            upstream, fixed, why = self._build(
                sharding, one_layer_of_each(self.text_config)
            )
            alone = whole.upstream if upstream is not None else None
            self._builds[sharding] = replace(
                whole,
                upstream=alone and alone.with_mlps_of(upstream.placed),
                fixed=whole.fixed.with_mlps_of(fixed.placed),
                upstream_moe=upstream and upstream.moe_layer,
                fixed_moe=fixed.moe_layer,
                upstream_refusal=whole.upstream_refusal or why,
            )
        return self._builds[sharding]

    def plan(self, deployment: Deployment) -> DeploymentPlan:
        """Size ``deployment`` (validated here first)."""
        validate(self.text_config, deployment)
        built = self._built(deployment)
        try:
            kv = built.kv.with_decode_context(deployment.dcp_size)
        except DecodeContextRefused as error:
            raise PlanError(str(error)) from error
        num_layers = self.text_config["num_hidden_layers"]
        ranges = pipeline_stages(num_layers, deployment.pp_size)
        last = len(ranges) - 1
        alone = built.upstream
        stages = tuple(
            StageAllocation(
                index=index,
                layers=(start, end),
                upstream=alone and alone.stage(start, end, index == 0, index == last),
                fixed=built.fixed.stage(start, end, index == 0, index == last),
            )
            for index, (start, end) in enumerate(ranges)
        )
        moe = MoeMemoryPlan(
            deployment=deployment,
            moe_layers=moe_layer_count(self.text_config),
            logical_intermediate_per_rank=deployment.intermediate_per_gpu(
                self.text_config["moe_intermediate_size"]
            ),
            upstream=built.upstream_moe,
            fixed=built.fixed_moe,
            upstream_refusal=built.upstream_refusal
            or built.fixed_moe.vllm_alone_refused,
        )
        plan = DeploymentPlan(
            moe=moe,
            serving=self.serving,
            stages=stages,
            kv_cache=kv.shape,
            serve_commands=tuple(
                serve_commands(
                    deployment,
                    self.serving,
                    self.budget,
                    self.model,
                    self.gpus_per_node,
                    self.speculation and self.speculation.spec,
                    serving_environment(),
                )
            ),
            nodes=node_split(deployment, self.gpus_per_node),
            speculative_config=self.speculation and self.speculation.spec,
            not_counted=NOT_COUNTED + ((NO_DRAFT,) if self.speculation is None else ()),
        )
        if self.budget is None:
            return plan
        budget = self._kv_budget(kv.vllm_config.cache_config)
        # vLLM alone's KV cache, where it starts: it builds and can run it
        runs = alone is not None and moe.upstream_refusal is None
        return replace(
            plan,
            budget=budget,
            upstream_kv=self._capacity(budget, kv, stages, ranges, "upstream")
            if runs
            else None,
            fixed_kv=self._capacity(budget, kv, stages, ranges, "fixed"),
        )

    def _kv_budget(self, cache_config: Any) -> KvBudget:
        """The budget asked, as the installed vLLM shares the GPU out
        under the serving GPUs' ``cache_config``; a ``BudgetError`` (for
        every layout alike) where vLLM would not start on it."""
        assert self.budget is not None
        if self.budget not in self._kv_budgets:
            self._kv_budgets[self.budget] = kv_budget(self.budget, cache_config)
        return self._kv_budgets[self.budget]

    @staticmethod
    def _capacity(
        budget: KvBudget,
        kv: KvCachePlanner,
        stages: Iterable[StageAllocation],
        ranges: list[tuple[int, int]],
        side: str,
    ) -> Any:
        available = [
            budget.kv_cache_bytes(getattr(stage, side).total_bytes) for stage in stages
        ]
        return kv.capacity(available, ranges)

    def advise(
        self,
        gpus: int,
        quantization: str,
        backend: str,
        online: str | None = None,
        online_config: str | None = None,
    ) -> tuple[list[DeploymentPlan], list[str]]:
        """Every layout of exactly ``gpus`` GPUs vLLM builds for the format
        and kernel (quantized while loading by ``online`` with
        ``online_config``, if given), sized,
        fitting first and then by KV-cache tokens; and the layouts vLLM
        refused at build time, each with its reason."""
        plans, refused = [], []
        for topology in layouts(gpus, self.text_config):
            deployment = Deployment.of(
                topology, backend, quantization, online, online_config
            )
            try:
                plans.append(self.plan(deployment))
            except (DeploymentError, PlanError) as error:
                refused.append(f"{deployment.label()}: {error}")
        plans.sort(key=_advice_order)
        return plans, refused


# What ``vllm serve`` allocates beside the parameters the planner counts.
NOT_COUNTED = (
    "what kernels add after loading (MLA's absorbed matrices)",
    "the vision tower's RoPE table (134 MB, made at its first forward)",
)
# ... and without --speculative-config
NO_DRAFT = "a speculative draft's weights and KV cache (--speculative-config)"


def _advice_order(plan: DeploymentPlan) -> tuple[Any, ...]:
    """Fitting with the plugin first, then most KV-cache tokens, then the
    fewest weights on the heaviest GPU."""
    kv = plan.fixed_kv
    tokens = kv.tokens if kv is not None else 0
    return (not plan.fits("fixed"), -tokens, plan.fixed.total_bytes)


def plan_deployment(
    text_config: dict[str, Any],
    deployment: Deployment,
    serving: Serving | None = None,
    budget: GpuBudget | None = None,
    quantization_config: dict[str, Any] | None = None,
) -> DeploymentPlan:
    """Size one deployment (a ``Planner`` of its own; ``quantization_config``:
    a checkpoint's own, else the format's published one)."""
    with Planner(
        text_config, serving, budget, quantization_config=quantization_config
    ) as planner:
        return planner.plan(deployment)
