"""One GPU rank, on the meta device: vLLM's real Kimi-K3 model built as one
rank of a deployment builds it on its GPU, on a CPU, allocating nothing (the
layer the tools ask vLLM's build through; what a CPU lacks is stood in,
below).

Offline only (``plan``, ``check --moe-backend`` and ``--serve-command``,
``selftest``, the test suite): nothing here runs in a serving process.
``vllm_config`` makes the ``VllmConfig`` ``vllm serve`` would, ``rank``
poses the process as a rank, ``whole_model`` builds the language model on
``meta`` and ``allocation`` reads what it allocates, ``kv_cache`` sizes the
KV cache with vLLM's own planner, ``kernel_gpus`` asks which MoE kernels
vLLM selects on which GPU; ``quiet`` keeps vLLM's output off the terminal
meanwhile. It builds what ``tools.deployment`` describes, and imports
nothing else of the tools.

Stand-in ledger
---------------
Building on a CPU box replaces, for the duration of a ``with`` block only
(``patching.replaced_attributes``, restored exactly on exit), what the build
reads from a GPU. None of them holds parameters: every parameter the model
allocates is vLLM's own. At a vLLM bump, re-check each "Re-check" line; the
suite's build tests fail when a name moves.

``rank.simulated_rank``
    Replaces ``vllm.distributed.parallel_state._TP``, ``_DP``, ``_PCP``,
    ``_DCP``, ``_PP``, ``_EP`` (``GroupStandIn``, with the rank's place in each).
    Why: without GPUs there are no torch.distributed groups; layers read
    only each group's size, this rank and first/last rank. Re-check: the
    group globals' names and the attributes layers read from them.
``stand_ins.cuda_streams_and_events``
    Replaces ``torch.cuda.Stream`` and ``torch.cuda.Event``. Why: the model
    creates them for overlapping work; a CPU box has no CUDA runtime.
    Re-check: nothing in vLLM (torch's names).
``stand_ins.mla_attention_kernels``
    Replaces ``get_attn_backend`` and ``get_mla_prefill_backend`` as
    ``vllm.models.kimi_k3.nvidia.mla`` looks them up: a FlashMLA backend
    subclass whose kernel object is a stand-in (with FlashMLA's LSE base,
    which vLLM's own DCP manager reads under ``--decode-context-parallel-size``).
    Why: MLA's kernels are chosen for, and imported on, the GPU. Re-check:
    the two names in ``mla.py``; that FlashMLA's block sizes still match the
    GPU's first choice.
``stand_ins.sparse_mla_attention_kernels``
    Replaces ``get_attn_backend`` (for a sparse request only) and
    ``get_mla_prefill_backend`` as vLLM's generic
    ``model_executor.layers.attention.mla_attention`` looks them up: a
    FlashMLA sparse backend subclass whose kernel is FlashMLA sparse's
    implementation class with its ``__init__`` (which sizes workspaces and
    asks the GPU its SM count) not run. Why: vLLM 0.34 builds a config's
    ``dsa_config`` layers as sparse MLA through that module; a CPU box has
    no sparse MLA backend. Re-check: the two names in ``mla_attention.py``;
    that FlashMLA sparse's KV-cache spec still matches Hopper's first choice.
``stand_ins.linear_kernels_on_their_gpu``
    Replaces ``vllm.model_executor.kernels.linear.current_platform`` (as
    CUDA) and ``is_supported`` of every CUDA kernel in its private
    ``_POSSIBLE_*_KERNELS`` tables. Why: a quantized linear layer (FP8
    block, NVFP4, and those an online method such as ``fp8_per_channel``
    quantizes) needs a kernel to be built. Re-check: those private tables.
``stand_ins.moe_kernels_on_their_gpu``
    Replaces ``_supports_current_device`` of every ``FusedMoEExperts``
    subclass, ``current_platform.supports_fp8`` and
    ``fused_moe.oracle.unquantized.current_platform`` (as CUDA) and
    ``quantization.moe_wna16.current_platform`` (as a Hopper GPU, compute
    capability 9.0). Why: vLLM picks the MoE kernel ``--moe-backend`` names
    by asking the device; AutoAWQ's fallback kernel asks its capability.
    Re-check: the device-check name; the unquantized oracle's and
    ``MoeWNA16Config``'s platform use.
``stand_ins.compressed_tensors_mxfp4_kernel``
    Replaces ``CutlassExpertsMxfp4._supports_current_device`` (on top of
    ``moe_kernels_on_their_gpu``). Why: the compressed-tensors MXFP4 method
    picks CUTLASS or Marlin from the GPU alone, not from ``--moe-backend``;
    the planner's ``cutlass``/``marlin`` name the GPU it runs on. Re-check:
    how ``CompressedTensorsW4A4Mxfp4MoEMethod`` picks its kernel.
``stand_ins.kda_prefill_kernel_of_the_gpu``
    Sets each built KDA layer's ``kda_prefill_backend`` to what a GPU
    resolves (FlashKDA). Why: it decides the KDA state blocks per sequence
    in the KV cache; building with FlashKDA imports its CUDA library.
    Re-check: ``resolve_kda_prefill_backend``'s choice on CUDA.
``stand_ins.a_cuda_device``
    Replaces ``current_platform.current_device`` (as ``cuda:0``). Why:
    ``KimiK3ForConditionalGeneration`` asks for it to move the vision tower,
    which it skips on ``meta``; a CPU box's platform has no current device.
    Re-check: the wrapper's ``__init__``.
``stand_ins.moe_forward_on_cpu``
    Defines ``torch.ops._C.situ_and_mul`` with a CPU kernel (vLLM's own
    ``SituAndMul.forward_native``) and replaces ``fused_batched_moe.
    _is_capturing_or_compiling`` (compile check only). Why: vLLM's batched
    reference MoE kernel, which ``selftest`` on a CPU and the forward tests
    run, calls the CUDA SiTU op of ``vllm._C`` and asks the CUDA driver
    whether a graph is being captured; a CPU box has neither. Re-check: the
    op's schema and the capture check's name in ``fused_batched_moe``.
``stand_ins.online_method_quantizers``
    Replaces ``mxfp4_utils.downcast_to_mxfp`` (online MXFP4) by the torch
    reference triton_kernels ships, and defines ``torch.ops._C``'s
    ``scaled_fp4_quant.out``, ``static_scaled_fp8_quant`` and
    ``dynamic_per_token_scaled_fp8_quant`` (online NVFP4, FP8 per tensor,
    FP8 per channel) with vLLM's own torch references (CPU) and a kernel
    that writes nothing (``meta``), each only where the op is missing, while
    ``build_rank`` builds a rank. Why: an online method's partition rule is
    learned from what its ``process_weights_after_loading`` quantizes to
    (``online.quantized_rule``), which calls these GPU quantizers; a CPU box
    has neither ``vllm._C`` nor Triton. The test suite quantizes with the
    same stand-ins (one place). Re-check: each op's schema in
    ``vllm/_custom_ops.py`` and the online methods' calls.
``stand_ins.all_reduce_over_one_gpu``
    Replaces ``torch.distributed.all_reduce`` (the tensor as it is: a group
    of one) and ``quant_utils``' ``get_ep_group``/``get_tp_group`` (a group
    whose ``device_group`` is None) while an online method quantizes (plan's
    linear layers on ``meta``, the suite's experts on the CPU). Why: online
    FP8 per tensor and per channel, INT8 and NVFP4 take a weight's maximum
    over the GPUs sharding it; one process has no process group. On
    ``meta`` it changes no shape. Re-check: ``quant_utils.amax_for_*``.
``stand_ins.one_gpu_for_the_data_parallel_group``
    Replaces a rank's ``FusedMoEConfig.moe_parallel_config`` by a copy with
    DP size 1 while ``selftest`` on a GPU makes its kernel
    (``process_weights_after_loading``). Why: with DP, vLLM makes an
    all-gather/reduce-scatter prepare/finalize over the DP group, which one
    GPU posing as every rank cannot form; the selftest sums the ranks
    itself. Re-check: ``all2all_utils.maybe_make_prepare_finalize``'s
    reading of ``dp_size``; the default ``all2all_backend``.
``stand_ins.a_cuda_platform_for_the_parser``
    Replaces ``current_platform.device_type`` (as ``cuda``) while ``check
    --serve-command`` builds ``vllm serve``'s argument parser. Why: the
    parser makes each config's defaults, and ``DeviceConfig("auto")`` asks
    the platform for a device type a CPU box's platform does not have.
    Re-check: that building the parser still reads only that.
``stand_ins.the_serving_gpus_capability``
    Replaces the current platform class's ``get_device_capability`` (as a
    Hopper GPU, 9.0; within ``a_gpu_of_capability``, ``plan --gpu``'s, also
    while the model is built) while ``vllm_config`` makes the ``ModelConfig`` and
    ``VllmConfig`` of GPUs that are not this host's (``plan``, ``check``; not
    ``selftest`` on a GPU, which runs this GPU's kernel). Why: vLLM refuses a
    quantization method below its minimum capability and resolves the model
    dtype from the current GPU; the host running the tools (a CPU box: no
    capability; an older GPU: a refusal or float16) is not the serving GPU.
    Every Kimi-K3 format's minimum is at most 8.0. Re-check:
    ``VllmConfig._get_quantization_config``, ``CudaPlatform.supported_dtypes``
    and any new capability check in config construction.
``stand_ins.amd_gpu.as_on_the_named_amd_gpu``
    Enters ``stand_ins.rocm_platform.an_amd_gpu`` (the current platform class's
    ``_enum`` as ROCm, ``vllm.platforms.rocm``'s architecture flags as its own
    code derives them for the GPU's ``gcnArchName``, AITER's switches in
    ``vllm._aiter_ops`` as ``VLLM_ROCM_USE_AITER`` sets them, emulation's
    ``has_quark``), ``moe_forward.situ_and_mul_op_on_cpu`` and
    ``moe_forward.silu_and_mul_op_on_cpu`` (the DSpark draft's MLPs ask for it
    on a CUDA-like platform) while ``build_rank`` makes the config and builds
    the model for an AMD GPU (``plan --gpu mi300x``, ``check --gpu``;
    ``gpus.an_amd_gpu_named``), in place of ``moe_kernel_of_the_gpu`` (ROCm's
    kernels answer their own device checks); for an Intel GPU (``--gpu
    max1550``), where vLLM builds the same AMD model,
    ``rocm_platform.an_intel_gpu`` instead (the platform enum as XPU,
    emulation's ``has_quark``), and ``vllm_config`` leaves the extensible KV
    cache to vLLM (off there). Why: vLLM selects the AMD MoE kernel from the
    platform, the GPU architecture and AITER, none of which a CPU box has.
    Re-check: ``rocm_platform``'s own list.
``stand_ins.rocm_model.vllms_amd_model_on_cpu``
    On an AMD GPU, while ``build_rank`` builds: replaces
    ``vllm.models.kimi_k3``'s exports ``KimiLinearForCausalLM``,
    ``KimiK3ForConditionalGeneration`` and ``KimiK3MTP`` by vLLM's AMD
    classes (what the package exports when imported on ROCm; the model
    registry's ``_try_load_model_cls`` cache emptied on entry and exit),
    ``current_platform.current_device`` (as ``meta``), and, where ``aiter``
    is absent, makes ``aiter.ops.triton.gated_delta_net`` importable with
    the one kernel handle the AMD KDA layer takes where AITER is on, and on
    vLLM 0.33 ``vllm.config.vllm.HAS_TRITON`` (True, as on the GPU: it picks
    the model runner, whose V1 refuses DSpark drafts). Why:
    the package chose its classes under this box's CPU platform; the AMD
    wrapper moves its vision tower to the current device; the KDA layer
    imports an AITER kernel it runs only in the forward. Re-check: the
    package's exports, the registry's cache, the AMD KDA layer's imports.
``stand_ins.rocm_attention.rocm_mla_attention_kernels``
    On an AMD GPU: replaces ``get_attn_backend`` and
    ``get_mla_prefill_backend`` as ``model_executor.layers.attention.
    mla_attention`` (the AMD MLA layers; a sparse request keeps its own
    stand-in) and ``models.kimi_k3.nvidia.mla`` (the DSpark draft's) look
    them up: vLLM's own selector, asked with ``vllm.platforms``' current
    platform as vLLM's ``RocmPlatform`` (its cache emptied on entry and
    exit), whose backend keeps its classes and gets its implementation
    class with ``__init__`` not run. Why: ROCm's selection depends on the
    architecture and AITER, a CPU box's selector offers CPU backends only,
    and AITER MLA's implementation imports AITER's kernels. Re-check: the
    two names in both modules, ``RocmPlatform.get_attn_backend_cls``, the
    selector's cache name; ``rocm_model.fused_kda_chunk_would_run`` (the
    one compiled op it stands in as present, and vLLM's cache of the
    answer).
``whole_model.with_the_nvidia_signature``
    On an Intel GPU: the NVIDIA model's ``KimiDecoderLayer`` builds vLLM's
    AMD ``KimiMoE`` (``amd/linear.py``, upstream's or the plugin's) for its
    MoE layers; the rest of the model is the NVIDIA one. Why: the routed
    experts' partition, what differs by platform, is the AMD layer's own;
    XPU's attention kernels are not stood in (``plan`` says so).
    Re-check: both decoder layers' ``KimiMoE`` signatures.
``whole_model.kimi_moe_class``
    Replaces ``vllm.models.kimi_k3.nvidia.model.KimiMoE`` (the global
    ``KimiDecoderLayer`` builds). Why: to build the same model with vLLM's
    own class and with the plugin's. Re-check: the global's name.
``stand_ins.cuda_hybrid_kv_cache``
    Replaces the current platform class's ``support_hybrid_kv_cache`` (True,
    as ``CudaPlatform``'s) while ``vllm_config`` makes a ``VllmConfig`` and
    while a draft is loaded (vLLM's draft loaders remake the config with
    ``vllm.config.replace``). Why: the CPU platform turns off, or refuses,
    the hybrid KV-cache manager that groups Kimi-K3's MLA and KDA layers on
    CUDA. Re-check: ``VllmConfig``'s hybrid KV-cache rules.
``stand_ins.cuda_graph_capture_sizes``
    Replaces the current platform class's ``support_static_graph_mode``
    (True, as ``CudaPlatform``'s) while ``vllm_config`` makes a
    ``VllmConfig``. Why: on a CPU platform vLLM captures no CUDA graph and
    leaves ``max_cudagraph_capture_size`` None, which MoE kernels read
    (vLLM 0.34's FlashInfer CuteDSL experts compare it with 0); on CUDA
    vLLM sizes the capture range itself. Re-check: where ``VllmConfig``
    calls ``_set_cudagraph_sizes``.
``stand_ins.cuda_extensible_kv_cache``
    Replaces the current platform's ``is_cuda_alike`` (True) and ``is_rocm``
    (False) while ``VllmConfig`` settles the extensible KV cache (vLLM 0.34's
    ``_resolve_extensible_kv_cache``, named by ``compat``; nothing on 0.33),
    as ``vllm_config`` makes a config. Why: it is on by default on CUDA, and
    with it vLLM takes all of each GPU and sizes the KV cache after warmup
    (``kv_budget``); a CPU box's platform turns it off. Re-check: what that
    method asks of the platform.
``stand_ins.weightless_model_loader``
    Replaces ``vllm.model_executor.model_loader.get_model`` (and the name
    ``v1/worker/gpu/spec_decode/eagle/utils.py`` imported) while
    ``draft.build_draft`` runs vLLM's draft loader: the draft is built by
    ``initialize_model`` on ``meta`` under the draft config vLLM made, and
    nothing is loaded. Why: the tools have no weights and no GPU. Re-check:
    that ``load_dspark_model`` and ``load_eagle_model`` still call
    ``get_model``, and from where.
``stand_ins.vllm_without_its_package_initialiser``
    Replaces the ``vllm`` package module (in ``sys.modules``) by one made
    from its spec and not executed, while ``doctor`` imports ``vllm.plugins``,
    ``vllm.version`` and ``vllm.platforms``. Why: ``vllm/__init__.py``
    imports torch's compiler (``vllm.env_override``) for settings the plugin
    loader never reads: seconds of a question that takes one. Re-check:
    ``vllm/plugins/__init__.py``'s imports (``vllm.envs`` only).
``vllm_config.parallel_config``
    Names the distributed executor backend vLLM resolves on the serving
    nodes (``mp``) and the ``--nnodes`` launch node 0's serve line asks for
    (values, not stand-ins). Why: left unnamed, ``ParallelConfig`` compares
    the world size with this host's GPU count on a CUDA host. Re-check:
    ``ParallelConfig.__post_init__``'s backend resolution; the contract test
    ``tests/upstream_contract/test_multi_node_vllm.py``.
"""
