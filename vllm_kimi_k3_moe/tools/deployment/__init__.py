"""A Kimi-K3 deployment, and what it needs: the wing every tool reads it from.

``plan`` sizes deployments, ``check`` holds a checkpoint to one, ``selftest``
runs one GPU's share of one; all three describe the deployment with these
modules. They are plain Python (no torch; vLLM only inside ``kv_budget``'s
functions that ask it) and import nothing of the other tool packages, so a
command validates its input before it pays for vLLM's import; what asks
vLLM more lives above, where it is used: which kernels run on
which GPU in ``meta_rank.kernel_gpus``, ``--max-model-len`` in
``plan.max_model_len``, a ``vllm serve`` line read back in
``check.serve_line``.

What is deployed
    ``text_config``   Kimi-K3's published text config; reading a ``config.json``.
    ``topology``      the layout (TP, PP, DP, EP, DCP), the serving options,
                      what each GPU holds; refusals in vLLM's own words.
    ``tp_sizes``      the tensor-parallel sizes that build, where one does not.
    ``nodes``         how a layout spreads over nodes in vLLM's launch.
    ``speculation``   the ``--speculative-config`` draft a deployment runs.
    ``public_drafts`` the public drafts' configs, resolved by name.

On which GPUs, in how much memory
    ``gpus``          GPU presets (``--gpu NAME``): memory as vLLM sees it.
    ``gpu_budget``    what one GPU is asked to give vLLM.
    ``kv_budget``     what the installed vLLM leaves the KV cache (vLLM's rules).

Asked again
    ``remembered``    answers worked out before, kept on disk.
"""
