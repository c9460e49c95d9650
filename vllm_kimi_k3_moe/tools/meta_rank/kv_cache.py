"""Kimi-K3's KV cache per GPU, from the specs vLLM's built layers report.

After the whole language model is built for a rank (``whole_model``), this
does what vLLM 0.33.0's engine does at start-up, with vLLM's own functions:
the platform fixes the block size (``Platform.update_block_size_for_backend``,
which for a hybrid model aligns the MLA pages with the KDA state pages), the
worker collects every attention layer's spec (``get_kv_cache_spec``: one
``MLAAttentionSpec`` per MLA layer, one ``MambaSpec`` per KDA layer), and the
engine groups them and sizes the block pool for the memory left
(``get_kv_cache_configs``), then states the capacity as vLLM logs it
(``get_kv_cache_capacity``: tokens = full-length requests x max_model_len,
because KDA state is held per sequence, not per token). Under decode context
parallelism vLLM's planner spreads each request's MLA tokens over the DCP
group (MLA specs are DCP-sharded, KDA specs are not): the same specs are
sized under a ``ParallelConfig`` with the DCP size set
(``KvCachePlanner.with_decode_context``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm_kimi_k3_moe.patching import replaced_attributes
from vllm_kimi_k3_moe.tools.deployment.gpus import XPU, named_amd_arch
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import kda_prefill_kernel_of_the_gpu
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.rocm_attention import (
    mla_backend_on_the_named_amd_gpu,
)
from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.rocm_model import (
    fused_kda_chunk_would_run,
)


@dataclass(frozen=True)
class KvCacheShape:
    """What one GPU's KV cache is made of, read from vLLM's specs."""

    block_size: int  # tokens per block, after vLLM's hybrid alignment
    mla_layers: int  # dense and sparse (DSA) alike
    kda_layers: int
    mla_bytes_per_token: int  # all MLA layers together (latent + rope)
    kda_bytes_per_sequence: int  # all KDA layers' conv + recurrent state
    page_bytes: int  # one MLA layer's block (one KDA layer's, padded to it)
    # GPUs a sequence's MLA tokens are spread over (--decode-context-parallel-size):
    # a GPU holds mla_bytes_per_token for one token in dcp_size; KDA state whole
    dcp_size: int = 1
    # layers vLLM's grouping adds so that every group has as many layers
    # (_generate_kv_cache_groups: a draft's MLA layers change the group size)
    padding_layers: int = 0
    # DSA (sparse MLA) layers, each with an indexer whose keys are cached per
    # token beside its MLA cache (a config with dsa_config, on a vLLM that
    # builds DSA layers)
    dsa_layers: int = 0
    indexer_bytes_per_token: int = 0  # all DSA layers' indexer keys
    # on an AMD GPU, the backend vLLM's ROCm selector picked for the MLA
    # layers, by vLLM's name (None elsewhere: NVIDIA's stand-in is FlashMLA's
    # block sizes, ``stand_ins.mla_backend_stand_in``, not a selection)
    rocm_mla_backend: str | None = None
    # on an AMD GPU: vLLM's KDA layers would keep one prefill-checkpoint
    # state block per request more with vLLM's fused KDA chunk kernel, a
    # build option of vLLM's ROCm wheel this machine cannot tell (not sized)
    kda_checkpoint_if_fused: bool = False

    @classmethod
    def of(cls, specs: dict[str, Any]) -> KvCacheShape:
        from vllm.v1.kv_cache_interface import (
            MambaSpec,
            MLAAttentionSpec,
            SparseCacheRole,
        )

        caches = [s for s in specs.values() if isinstance(s, MLAAttentionSpec)]
        indexer = [s for s in caches if s.cache_role == SparseCacheRole.INDEXER]
        mla = [s for s in caches if s.cache_role != SparseCacheRole.INDEXER]
        kda = [s for s in specs.values() if isinstance(s, MambaSpec)]
        if len(caches) + len(kda) != len(specs) or not mla:
            kinds = sorted({type(s).__name__ for s in specs.values()})
            raise ValueError(f"unexpected Kimi-K3 KV-cache specs: {kinds}")
        return cls(
            block_size=mla[0].block_size,
            mla_layers=len(mla),
            kda_layers=len(kda),
            mla_bytes_per_token=sum(s.page_size_bytes // s.block_size for s in mla),
            kda_bytes_per_sequence=sum(s.real_page_size_bytes for s in kda),
            page_bytes=mla[0].page_size_bytes,
            dsa_layers=len(indexer),
            indexer_bytes_per_token=sum(
                s.page_size_bytes // s.block_size for s in indexer
            ),
        )


@dataclass(frozen=True)
class KvCapacity:
    """The KV cache vLLM would allocate next to the weights: its tokens at
    ``max_model_len`` and the full-length requests they are. Zero when vLLM
    would refuse to start (no memory left, or less than one request), with
    vLLM's reason and, for a KV cache too small, the longest context vLLM
    estimates would fit."""

    available_bytes: int  # on the binding GPU (pipeline stage)
    tokens: int
    concurrency: float
    refusal: str | None = None  # vLLM's reason, when it would not start
    binding_stage: int = 0  # the pipeline stage with the least KV cache
    fitting_max_model_len: int | None = None  # vLLM's estimate, when refused


class DecodeContextRefused(ValueError):
    """vLLM's attention selector takes no MLA backend, or another one, under
    a decode-context-parallel size (one line: vLLM's reason)."""


_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
_ESTIMATED_MAX_LEN = re.compile(r"estimated maximum model length is (\d+)")


class KvCachePlanner:
    """The KV-cache specs of a rank built under ``vllm_config`` and vLLM's
    block-pool sizing for any amount of memory."""

    def __init__(self, vllm_config: Any) -> None:
        from vllm.platforms.interface import Platform
        from vllm.v1.core.single_type_kv_cache_manager import (
            register_all_kvcache_specs,
        )
        from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

        self.vllm_config = vllm_config
        if named_amd_arch() in (None, XPU):  # NVIDIA's KDA layers
            kda_prefill_kernel_of_the_gpu(vllm_config)
        # What the CUDA platform runs after loading the model (CudaPlatform
        # does not override it): block size and hybrid page alignment.
        Platform.update_block_size_for_backend(vllm_config)
        register_all_kvcache_specs(vllm_config)
        self.specs = get_kv_cache_spec(vllm_config)
        self._resolve_layout()
        dcp = vllm_config.parallel_config.decode_context_parallel_size
        self.shape = replace(
            KvCacheShape.of(self.specs),
            dcp_size=dcp,
            padding_layers=self._padding_layers(),
            rocm_mla_backend=self._rocm_mla_backend(),
            kda_checkpoint_if_fused=self._kda_checkpoint_if_fused(),
        )
        # the advisor asks the same again (vLLM alone and the plugin often
        # leave the same memory, and every DCP size of a layout is asked)
        self._by_dcp: dict[int, KvCachePlanner] = {dcp: self}
        self._capacities: dict[tuple[tuple[int, ...], tuple], KvCapacity] = {}

    def _padding_layers(self) -> int:
        """The layers vLLM's grouping pads the model's KV cache with: each
        group of one spec per layer holds as many layers as the largest, the
        empty places allocated but unused (vLLM logs "Add N padding
        layers"). Groups that pack several layers' pages into each block (a
        ``UniformTypeKVCacheSpecs``: DSA layers with their indexers, under a
        block-outermost layout) are not padded so."""
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
        from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

        groups = [
            group
            for group in get_global_kv_cache_groups(
                self.vllm_config, [copy.deepcopy(self.specs)]
            )
            if not isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
        ]
        if not groups:
            return 0
        size = max(len(group.layer_names) for group in groups)
        return sum(size - len(group.layer_names) for group in groups)

    def _mla_layer(self) -> Any:
        """The first of the target's dense MLA layers (vLLM's built one)."""
        from vllm.v1.kv_cache_interface import MLAAttentionSpec

        layers = self.vllm_config.compilation_config.static_forward_context
        return next(
            layers[name]
            for name, spec in self.specs.items()
            if isinstance(spec, MLAAttentionSpec)
            and not layers[name].get_attn_backend().is_sparse()
        )

    def _rocm_mla_backend(self) -> str | None:
        if named_amd_arch() in (None, XPU):
            return None
        return self._mla_layer().get_attn_backend().get_name()

    def _kda_checkpoint_if_fused(self) -> bool:
        """On an AMD GPU: whether the first KDA layer's own
        ``get_kv_cache_spec`` gives a prefill-checkpoint block more were its
        prefill kernel the fused one, where vLLM would run it
        (``rocm_model.fused_kda_chunk_would_run``) and the build here did not
        resolve it (this machine has not the compiled op)."""
        from vllm.v1.kv_cache_interface import MambaSpec

        if named_amd_arch() in (None, XPU) or not fused_kda_chunk_would_run():
            return False
        layers = self.vllm_config.compilation_config.static_forward_context
        name, spec = next(
            (name, spec)
            for name, spec in self.specs.items()
            if isinstance(spec, MambaSpec)
        )
        with replaced_attributes(layers[name], kda_prefill_backend="fused"):
            fused = layers[name].get_kv_cache_spec(self.vllm_config)
        return fused.num_prefill_checkpoint_blocks > spec.num_prefill_checkpoint_blocks

    def with_decode_context(self, dcp_size: int) -> KvCachePlanner:
        """This rank's specs sized by vLLM's planner under
        ``--decode-context-parallel-size dcp_size``: the same specs (the
        layers build the same under DCP, which ``tests/upstream_contract``
        holds to a build with it), under a copy of the ``VllmConfig`` whose
        ``ParallelConfig`` vLLM remade with that DCP size (its validator
        runs). The planner then gives each request ``1/dcp_size`` of its
        MLA tokens on a GPU (MLA specs are DCP-sharded) and all of its KDA
        state (KDA specs are not)."""
        if dcp_size in self._by_dcp:
            return self._by_dcp[dcp_size]
        planner = copy.copy(self)
        planner.shape = replace(self.shape, dcp_size=dcp_size)
        planner.vllm_config = copy.copy(self.vllm_config)
        planner.vllm_config.parallel_config = replace(
            self.vllm_config.parallel_config, decode_context_parallel_size=dcp_size
        )
        planner._capacities = {}
        planner._same_backend_under_decode_context()
        self._by_dcp[dcp_size] = planner  # shared by the copies
        return planner

    def _same_backend_under_decode_context(self) -> None:
        """On an AMD GPU: vLLM's ROCm selector asked again for the MLA
        layers' backend under this planner's DCP size (``use_dcp``: each
        backend's ``validate_configuration`` says whether it takes DCP).
        Raises ``DecodeContextRefused`` with vLLM's reason where no ROCm
        backend takes the layer, or where it picks another backend than the
        one the specs were built with (not sized here). Elsewhere nothing
        is asked: NVIDIA's MLA backends all take DCP (the contract test
        ``test_context_parallel_rules_vllm`` holds it)."""
        backend = self._mla_layer().get_attn_backend()
        try:
            selected = mla_backend_on_the_named_amd_gpu(self.vllm_config, backend)
        except ValueError as error:  # vLLM's selector: no backend takes it
            raise DecodeContextRefused(
                f"vLLM's ROCm attention selector refuses DCP {self.shape.dcp_size}: "
                + str(error).split("\n")[0]
            ) from error
        if selected is not None and selected != self.shape.rocm_mla_backend:
            raise DecodeContextRefused(
                f"vLLM's ROCm attention selector picks {selected} under DCP "
                f"{self.shape.dcp_size} ({self.shape.rocm_mla_backend} without it), "
                "whose KV cache plan does not size (it sized the build without DCP)"
            )

    def _resolve_layout(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import (
            get_current_attn_backends,
        )
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
            resolve_kv_cache_layout,
        )

        layouts = [
            layout.name
            for layout in get_supported_kv_cache_layouts(
                get_current_attn_backends(self.vllm_config)
            )
        ]
        resolve_kv_cache_layout(self.vllm_config, [layouts], self.specs.values())

    def stage_specs(self, start: int, end: int) -> dict[str, Any]:
        """The specs of the attention layers a pipeline stage holding layers
        [start, end) builds."""
        return {
            name: spec
            for name, spec in self.specs.items()
            if start <= int(_LAYER_INDEX.search(name).group(1)) < end
        }

    def capacity(
        self, available: Sequence[int], stages: Sequence[tuple[int, int]] = ()
    ) -> KvCapacity:
        """What vLLM's engine core makes of ``available`` bytes on each
        pipeline stage's GPUs (``stages``: their layers [start, end); none:
        one stage holding every layer). vLLM groups the whole model's specs,
        sizes each stage's pool and gives every stage the smallest number of
        blocks; the binding stage is the one whose own pool is smallest."""
        last = 1 + max(self._layer_indices())
        stages = list(stages) or [(0, last)]
        # a speculative draft's layers (numbered after the target's) are on
        # the last stage, where vLLM's model runner loads the drafter
        stages[-1] = (stages[-1][0], max(stages[-1][1], last))
        key = (tuple(available), tuple(stages))
        if key not in self._capacities:
            self._capacities[key] = self._capacity(available, stages)
        return self._capacities[key]

    def _capacity(
        self, available: Sequence[int], stages: list[tuple[int, int]]
    ) -> KvCapacity:
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_kv_cache_capacity,
        )

        # vLLM's grouping edits the specs it is given.
        specs = [copy.deepcopy(self.stage_specs(*stage)) for stage in stages]
        groups = get_global_kv_cache_groups(self.vllm_config, specs)
        alone: list[KvCapacity] = []
        for stage_specs, memory in zip(specs, available, strict=True):
            if memory <= 0:
                alone.append(KvCapacity(memory, 0, 0.0, "no memory left for it"))
                continue
            try:
                configs = get_kv_cache_configs(
                    self.vllm_config, [stage_specs], [memory], groups
                )
            except ValueError as error:  # less than one full-length request
                message = str(error).split("\n")[0]
                estimate = _ESTIMATED_MAX_LEN.search(message)
                alone.append(
                    KvCapacity(
                        memory,
                        0,
                        0.0,
                        message,
                        fitting_max_model_len=int(estimate.group(1))
                        if estimate
                        else None,
                    )
                )
                continue
            tokens, concurrency = get_kv_cache_capacity(
                self.vllm_config, generate_scheduler_kv_cache_config(configs)
            )
            alone.append(KvCapacity(memory, tokens, concurrency))
        # the stage with the fewest tokens; among stages with none, the one
        # with the least memory for them
        binding = min(
            range(len(alone)),
            key=lambda i: (alone[i].tokens, alone[i].available_bytes),
        )
        if alone[binding].tokens == 0 or len(stages) == 1:
            return replace(alone[binding], binding_stage=binding)
        # Every stage fits a request: the pools vLLM sizes together.
        configs = get_kv_cache_configs(self.vllm_config, specs, list(available), groups)
        tokens, concurrency = get_kv_cache_capacity(
            self.vllm_config, generate_scheduler_kv_cache_config(configs)
        )
        return KvCapacity(
            available[binding], tokens, concurrency, binding_stage=binding
        )

    def _layer_indices(self) -> list[int]:
        return [int(_LAYER_INDEX.search(name).group(1)) for name in self.specs]
