"""A Kimi-K3 deployment, and what it needs: the wing every tool reads it from.

``plan`` sizes deployments, ``check`` holds a checkpoint to one, ``selftest``
runs one GPU's share of one; all three describe the deployment with these
modules. Most are plain Python (no torch, no vLLM), so a command validates
its input before it pays for vLLM's import; those that ask vLLM build on
``tools.meta_rank``.

What is deployed
    ``text_config``   Kimi-K3's published text config; reading a ``config.json``.
    ``topology``      the layout (TP, PP, DP, EP, DCP), the serving options,
                      what each GPU holds; refusals in vLLM's own words.
    ``max_model_len`` ``--max-model-len`` as vLLM reads it.
    ``tp_sizes``      the tensor-parallel sizes that build, where one does not.
    ``nodes``         how a layout spreads over nodes in vLLM's launch.
    ``speculation``   the ``--speculative-config`` draft a deployment runs.
    ``public_drafts`` the public drafts' configs, resolved by name.

On which GPUs, in how much memory
    ``gpus``          GPU presets (``--gpu NAME``): memory as vLLM sees it.
    ``gpu_budget``    what one GPU is asked to give vLLM.
    ``kv_budget``     what the installed vLLM leaves the KV cache (vLLM's rules).
    ``kernel_gpus``   which MoE kernels run on which GPU (vLLM's selection).

How it is launched, and asked again
    ``serve_line``    a ``vllm serve`` line read back into its layout.
    ``remembered``    answers worked out before, kept on disk.
"""
