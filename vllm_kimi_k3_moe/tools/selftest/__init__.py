"""``vllm-kimi-k3-moe selftest``: every rank's Kimi-K3 routed experts, built
through the plugin and run through vLLM's own MoE forward, summed as the
all-reduce sums them, against the unsharded experts.

One harness, two kernels. ``layer`` builds one rank's ``KimiMoE`` (its
``VllmConfig``, the plugin's partition, vLLM's loader); ``checkpoint`` reads
the one MoE layer's expert tensors it is filled from (a real checkpoint's,
or ``synthetic``'s); ``reference`` computes the unsharded experts in float64
from those tensors, dequantized to FP32 by vLLM's helpers (``dequantize``);
``harness`` runs every rank of a layout and sums them; ``run`` judges the
sum against the same kernel unsharded and builds vLLM alone's rank next to
it. Only ``kernels`` differs between a GPU and a CPU: on a GPU the rank's
weights go through ``process_weights_after_loading`` to the kernel
``--moe-backend`` selects on that GPU; on a CPU (CI) the kernel is chosen as
on the GPU that runs it, but the loaded weights are dequantized and run
through vLLM's CPU reference kernel, and nothing is timed (``timing``).
``report`` prints the screen and the JSON.

Offline only: a serving process never imports this package.
"""
