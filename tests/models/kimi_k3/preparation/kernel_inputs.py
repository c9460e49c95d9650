"""What a prepared rank must show whichever kernel runs it: the kernel made
by the preparation reads the prepared scales (not a copy left behind) and
only finite values from its quantization config, the rows resident are the
ones the plugin allocated (no pad again: no second copy while it pads), and
the layer's ``FusedMoEConfig`` still describes the plugin's layout.
"""

from __future__ import annotations

from typing import Any

# the FusedMoEQuantConfig tensors other than the weight scales
OTHER_TENSORS = (
    "a1_scale",
    "a1_gscale",
    "a2_scale",
    "a2_gscale",
    "g1_alphas",
    "g2_alphas",
    "w1_bias",
    "w2_bias",
)
REPADS = "re-pads"  # how ``layout_problems`` words a second pad


def quant_config(experts: Any) -> Any:
    """The quantization config of the kernel the preparation made."""
    return experts.quant_method.moe_kernel.fused_experts.quant_config


def kernel_input_problems(experts: Any) -> list[str]:
    """The kernel's weight scales are the prepared parameters, and every
    other floating tensor it reads is finite."""
    import torch

    config = quant_config(experts)
    found = []
    for name, scales in (("w13", config.w1_scale), ("w2", config.w2_scale)):
        parameter = getattr(experts, f"{name}_weight_scale", None)
        if (scales is None) != (parameter is None) or (
            scales is not None and scales.data_ptr() != parameter.data_ptr()
        ):
            found.append(f"{name}: the kernel's quant config holds other scales")
    for name in OTHER_TENSORS:
        value = getattr(config, name)
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        if floating and not torch.isfinite(value.float()).all():
            found.append(f"the kernel's {name} is not finite")
    return found


def layout_problems(experts: Any, choice: Any, width: int, rows: int) -> list[str]:
    """``rows``, the rows the kernel runs, are the plugin's allocation, and
    the layer's config is as the plugin left it."""
    found = []
    if rows != choice.allocated:
        found.append(
            f"preparation {REPADS} {choice.allocated} rows to {rows}: "
            f"{rows} resident, a second copy while it pads"
        )
    config = experts.moe_config
    if (config.intermediate_size_per_partition, config.hidden_dim) != (
        choice.allocated,
        width,
    ):
        found.append(
            "preparation rewrote the layer's FusedMoEConfig to "
            f"{config.intermediate_size_per_partition} rows, width {config.hidden_dim}"
        )
    return found
