"""LoRA slots: the driver's slot choice, and the weights a rank's layer slot holds under TP."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from platform_core.distributed.parallel_state import TPGroup
from platform_core.layers.linear import ColumnParallelLinear, RowParallelLinear
from platform_core.layers.sharding import Shard
from platform_core.lora.layers import LinearLoRA, LoRAStepState
from platform_core.lora.slots import LoRASlotTable
from platform_core.lora_request import LoRARequest

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("ABC", 1))


def test_a_step_gets_slots_token_slots_and_merged_segments():
    table = LoRASlotTable(max_loras=2)
    step = table.plan([A, A, None, B, None], [3, 2, 4, 1, 0])
    assert step is not None
    slot_a = next(s for s, a in step.adapters.items() if a == A)
    slot_b = next(s for s, a in step.adapters.items() if a == B)
    assert {slot_a, slot_b} == {0, 1}
    expected = [slot_a] * 5 + [-1] * 4 + [slot_b]
    assert step.token_slots.tolist() == expected
    assert step.token_slots.dtype == np.int32
    # A's two requests are adjacent: one segment.
    assert step.segments == ((0, 5, slot_a), (9, 10, slot_b))


def test_slots_stay_put_and_the_least_recently_used_one_is_reused():
    table = LoRASlotTable(max_loras=2)
    first = table.plan([A, B], [1, 1])
    slot_of = {a.lora_name: s for s, a in first.adapters.items()}
    table.plan([B], [1])  # A is now the least recently used
    third = table.plan([C, B], [1, 1])
    assert {a.lora_name: s for s, a in third.adapters.items()} == {
        "C": slot_of["A"],
        "B": slot_of["B"],
    }


def test_no_adapter_in_a_step_means_no_lora_plan_and_too_many_is_a_bug():
    table = LoRASlotTable(max_loras=2)
    assert table.plan([None, None], [3, 1]) is None
    with pytest.raises(RuntimeError, match="max_loras"):
        table.plan([A, B, C], [1, 1, 1])


def _full_weights(parts, in_features, out_sizes, rank, seed):
    generator = torch.Generator().manual_seed(seed)
    return {
        part: (
            torch.randn(rank, in_features, generator=generator),
            torch.randn(out, rank, generator=generator),
        )
        for part, out in zip(parts, out_sizes, strict=True)
    }


def _no_ops(*args):
    raise AssertionError("not called")


def _group(rank: int) -> TPGroup:
    """Rank ``rank`` of two, with a stand-in communicator (nothing here communicates)."""
    return TPGroup(rank, 2, SimpleNamespace(rank=rank, world_size=2))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_column_parallel_slot_holds_each_parts_rows_of_this_rank(rank):
    tp = _group(rank)
    in_features, outs = 6, (8, 4, 4)
    shards = [Shard(*tp.shard_range(out), out) for out in outs]
    linear = ColumnParallelLinear(in_features, shards, False, torch.float32, ("q", "k", "v"))
    lora = LinearLoRA(
        linear, ("q", "k", "v"), 2, 4, torch.float32, LoRAStepState(), _no_ops, _no_ops
    )
    weights = _full_weights(("q", "v"), in_features, (8, 4), rank=3, seed=rank)  # no k
    lora.write_slot(1, weights)
    assert lora.slice_sizes == (4, 2, 2)
    a, b = lora.lora_a[1], lora.lora_b[1]
    assert torch.equal(a[0, :3], weights["q"][0]) and torch.equal(a[2, :3], weights["v"][0])
    assert not a[1].any() and not a[:, 3:].any()  # k absent, rank 3 padded to 4
    rows_q = slice(4 * rank, 4 * rank + 4)
    rows_v = slice(2 * rank, 2 * rank + 2)
    assert torch.equal(b[0:4, :3], weights["q"][1][rows_q])
    assert not b[4:6].any()
    assert torch.equal(b[6:8, :3], weights["v"][1][rows_v])
    assert not lora.lora_a[0].any() and not lora.lora_b[0].any()  # other slots untouched


@pytest.mark.parametrize("rank", [0, 1])
def test_a_row_parallel_slot_holds_this_ranks_input_columns_of_a(rank):
    tp = _group(rank)
    linear = RowParallelLinear(8, 6, False, torch.float32, tp)
    lora = LinearLoRA(linear, ("o",), 1, 2, torch.float32, LoRAStepState(), _no_ops, _no_ops)
    weights = _full_weights(("o",), 8, (6,), rank=2, seed=5)
    lora.write_slot(0, weights)
    columns = slice(4 * rank, 4 * rank + 4)
    assert torch.equal(lora.lora_a[0, 0], weights["o"][0][:, columns])
    assert torch.equal(lora.lora_b[0], weights["o"][1])
