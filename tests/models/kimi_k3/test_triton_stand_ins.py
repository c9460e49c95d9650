"""The stand-ins for the CUDA ops around vLLM's Triton MoE kernel
(``stand_ins.triton_moe_forward_on_cpu``), called through vLLM's own
wrappers: the slot alignment against what ``moe_align_block_size``'s
docstring promises the kernel, the top-k sum against plain torch; the
interpreter's narrowing float casts against the FP8 grid and torch's."""

from __future__ import annotations

import torch

from vllm_kimi_k3_moe.tools.meta_rank.stand_ins import triton_moe_forward_on_cpu


def test_alignment_groups_every_slot_by_expert_in_whole_blocks():
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import (
        moe_align_block_size,
    )

    topk_ids = torch.tensor([[1, 2, 3], [0, 1, 3], [0, 2, 3], [0, 1, 2]])
    block = 4
    with triton_moe_forward_on_cpu():
        sorted_ids, expert_ids, total = moe_align_block_size(topk_ids, block, 4)
    sentinel = topk_ids.numel()
    flat = topk_ids.flatten()
    assert int(total) == 16  # 3 slots per expert, each padded to 4
    used = sorted_ids[: int(total)]
    assert sorted(int(i) for i in used if i != sentinel) == list(range(sentinel))
    for b in range(int(total) // block):
        slots = [int(i) for i in used[b * block : (b + 1) * block] if i != sentinel]
        assert all(int(flat[s]) == int(expert_ids[b]) for s in slots), b


def test_alignment_leaves_out_other_ranks_experts():
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import (
        moe_align_block_size,
    )

    topk_ids = torch.tensor([[0, 2], [1, 3]])
    expert_map = torch.tensor([-1, -1, 0, 1])  # this rank holds experts 2, 3
    with triton_moe_forward_on_cpu():
        sorted_ids, expert_ids, total = moe_align_block_size(
            topk_ids, 2, 4, expert_map, ignore_invalid_experts=True
        )
    assert int(total) == 4
    assert sorted_ids[:4].tolist() == [1, 4, 3, 4]
    assert expert_ids[:2].tolist() == [0, 1]


def test_topk_sum_adds_each_tokens_slots():
    from vllm import _custom_ops as ops

    rows = torch.randn(3, 2, 5)
    output = torch.empty(3, 5)
    with triton_moe_forward_on_cpu():
        ops.moe_sum(rows, output)
        held = torch.empty(3, 5)
        ops.moe_sum(rows, held, torch.tensor([[0, 1]] * 3), torch.tensor([0, -1]))
    assert torch.equal(output, rows.sum(dim=1))
    assert torch.equal(held, rows[:, 0])


def test_narrowing_float_casts_round_to_nearest_with_the_carry():
    """FP32 -> FP8 e4m3 (vLLM's Triton activation quantization), BF16, FP16:
    to nearest, ties to even, a round-up carrying into the exponent, as a
    GPU's ``cvt.rn`` rounds; the interpreter's own drops that carry."""
    import triton.language as tl
    from triton.runtime import interpreter

    from vllm_kimi_k3_moe.tools.meta_rank.stand_ins.triton_on_cpu import (
        _narrowing_float_cast,
    )

    values = torch.tensor([7.9, 31.0, 127.0, 100.0, 200.0, -154.0, 0.01, 447.0])
    # the e4m3 grid: 8 values a binade, 448 the largest
    fp8 = [8.0, 32.0, 128.0, 96.0, 192.0, -160.0, 0.009765625, 448.0]
    convert = _narrowing_float_cast(interpreter._convert_float)
    nearest = interpreter._ir.ROUNDING_MODE.RTNE  # what ``.to(fp8)`` asks
    for dtype, expected in (
        (tl.float8e4nv, torch.tensor(fp8).to(torch.float8_e4m3fn)),
        (tl.bfloat16, values.to(torch.bfloat16)),
        (tl.float16, values.to(torch.float16)),
    ):
        bits = convert(values.numpy(), tl.float32, dtype, nearest)
        assert bits.tobytes() == expected.view(torch.uint8).numpy().tobytes(), dtype
    own = interpreter._convert_float(values.numpy(), tl.float32, tl.float8e4nv, nearest)
    assert (
        torch.frombuffer(bytearray(own.tobytes()), dtype=torch.float8_e4m3fn)[2].item()
        == 64.0
    ), "the interpreter rounds 127 right now: drop the stand-in"
