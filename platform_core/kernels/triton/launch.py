"""Launch planning for the paged-attention kernel: tile sizes and the split-KV choice.

Pure Python (no triton import), so the planning rules are unit-tested without a device or the
interpreter. A backend tunes :class:`LaunchParams` for its hardware; :func:`plan_attention` turns
them and the shape of one batch into an :class:`AttentionPlan`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from platform_core.errors import ConfigError


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class LaunchParams:
    """Launch tunables of one backend.

    Attributes:
        block_m: query rows per program (query tokens x query heads of one KV head) when the
            batch holds a prefill chunk; decode-only batches use the smallest tile holding one
            group of query heads.
        block_n: keys per step of the inner loop (independent of the KV block size).
        num_warps, num_stages: passed to every launch.
        target_programs: programs that keep the device busy. A launch with fewer programs
            splits each sequence's keys across programs (flash-decoding) and combines the
            partial results in a second kernel; ``0`` never splits.
        split_min_tokens: the fewest keys worth a split of their own.
        max_splits: the most splits per sequence.
        options: extra launch keywords for the backend's Triton (e.g. ROCm's ``waves_per_eu``).
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int = 0
    split_min_tokens: int = 512
    max_splits: int = 16
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value != next_power_of_2(value):
                raise ConfigError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_min_tokens < 1 or self.max_splits < 1 or self.target_programs < 0:
            raise ConfigError(
                "split_min_tokens and max_splits must be >= 1 and target_programs >= 0, got "
                f"{self.split_min_tokens}, {self.max_splits}, {self.target_programs}"
            )

    def launch_options(self) -> dict[str, Any]:
        """Keywords every kernel launch of this backend receives."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **dict(self.options)}


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """How one paged-attention launch is laid out.

    A program owns ``block_q`` query tokens of one sequence times the ``block_m // block_q``
    query heads that share one KV head, and one of ``num_splits`` ranges of that sequence's
    keys. ``upcast`` computes the dot products in float32 (the interpreter's bf16 dot is wrong);
    ``dot_precision`` is ``"ieee"`` when the dot operands are float32 (no TF32 rounding).
    """

    block_m: int
    block_q: int
    block_n: int
    head_pad: int
    num_q_tiles: int
    num_splits: int
    upcast: bool
    dot_precision: str | None

    def grid(self, num_seqs: int, num_kv_heads: int) -> tuple[int, int, int]:
        """Programs: sequences x query tiles x (KV heads x splits)."""
        return (num_seqs, self.num_q_tiles, num_kv_heads * self.num_splits)


def choose_num_splits(programs: int, max_seq_len: int, params: LaunchParams) -> int:
    """Splits per sequence for a launch of ``programs`` unsplit programs (a power of two).

    Splitting pays when the batch alone leaves the device idle and the sequences are long.
    """
    if params.target_programs <= 0 or programs >= params.target_programs:
        return 1
    wanted = min(
        cdiv(params.target_programs, max(programs, 1)),
        max_seq_len // params.split_min_tokens,
        params.max_splits,
    )
    return 1 << (max(wanted, 1).bit_length() - 1)


def plan_attention(
    *,
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    params: LaunchParams,
    interpret: bool,
    num_splits: int | None = None,
) -> AttentionPlan:
    """The plan for one batch; ``num_splits`` forces a split count (CUDA graphs, tests)."""
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads={num_heads} is not a multiple of {num_kv_heads=}")
    if num_splits is not None and num_splits < 1:
        raise ConfigError(f"num_splits must be >= 1, got {num_splits}")
    group = num_heads // num_kv_heads
    head_pad = max(16, next_power_of_2(head_size))
    shrink = 2 if head_pad > 128 else 1  # wide heads: smaller tiles keep the accumulator small
    block_n = max(16, params.block_n // shrink)
    smallest = max(16, next_power_of_2(group))
    block_m = smallest if max_query_len <= 1 else max(smallest, params.block_m // shrink)
    block_q = block_m // group
    num_q_tiles = cdiv(max(max_query_len, 1), block_q)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs * num_q_tiles * num_kv_heads, max_seq_len, params)
    upcast = interpret and dtype == torch.bfloat16
    return AttentionPlan(
        block_m=block_m,
        block_q=block_q,
        block_n=block_n,
        head_pad=head_pad,
        num_q_tiles=num_q_tiles,
        num_splits=num_splits,
        upcast=upcast,
        dot_precision="ieee" if upcast or dtype == torch.float32 else None,
    )
