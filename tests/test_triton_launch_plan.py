"""Launch planning of the shared Triton kernels: tile sizes, split-KV counts and precision rules.

Plain Python (no kernel runs), so tested directly; the kernels themselves are checked in
``test_triton_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch

from platform_core.errors import ConfigError
from platform_core.kernels.triton.launch import LaunchParams, choose_num_splits, plan_attention


def _plan(**overrides):
    args = dict(
        num_seqs=4,
        max_query_len=1,
        max_seq_len=4096,
        num_heads=32,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.float16,
        params=LaunchParams(target_programs=256, split_min_tokens=512, max_splits=16),
        interpret=False,
    )
    return plan_attention(**{**args, **overrides})


def test_decode_plan_uses_the_smallest_tile_and_splits_long_contexts():
    plan = _plan()
    assert (plan.block_m, plan.block_q, plan.num_q_tiles) == (16, 4, 1)
    # 4 seqs x 8 KV heads = 32 programs, 256 wanted: 8 splits, allowed by 4096 / 512 = 8.
    assert plan.num_splits == 8
    assert plan.grid(4, 8) == (4, 1, 64)
    assert _plan(max_seq_len=1024).num_splits == 2  # only two splits' worth of keys
    assert _plan(num_seqs=64).num_splits == 1  # the batch alone fills the device
    assert _plan(num_splits=3).num_splits == 3


def test_prefill_plan_tiles_queries_and_shrinks_for_wide_heads():
    plan = _plan(max_query_len=100, num_seqs=64)
    assert (plan.block_m, plan.block_q, plan.num_q_tiles, plan.block_n) == (64, 16, 7, 64)
    wide = _plan(max_query_len=100, num_seqs=64, head_size=256)
    assert (wide.block_m, wide.block_n, wide.head_pad) == (32, 32, 256)
    odd = _plan(head_size=80, num_heads=9, num_kv_heads=3)
    assert (odd.head_pad, odd.block_m, odd.block_q) == (128, 16, 5)


def test_plan_precision_rules():
    assert _plan(dtype=torch.float32).dot_precision == "ieee"
    assert _plan(dtype=torch.bfloat16).dot_precision is None
    upcast = _plan(dtype=torch.bfloat16, interpret=True)
    assert upcast.upcast and upcast.dot_precision == "ieee"
    assert not _plan(dtype=torch.float16, interpret=True).upcast


def test_split_count_is_a_power_of_two_and_off_without_a_target():
    params = LaunchParams(target_programs=100, split_min_tokens=1, max_splits=64)
    assert choose_num_splits(programs=10, max_seq_len=10_000, params=params) == 8  # 10 -> 8
    assert choose_num_splits(10, 10_000, LaunchParams()) == 1


def test_invalid_launch_params_are_rejected():
    with pytest.raises(ConfigError, match="block_n must be a power of two"):
        LaunchParams(block_n=48)
    with pytest.raises(ConfigError, match="num_heads=6 is not a multiple"):
        _plan(num_heads=6, num_kv_heads=4)
    with pytest.raises(ConfigError, match="num_splits must be >= 1"):
        _plan(num_splits=0)
