"""LoRA shrink and expand for the CPU backend, as op overrides (``"lora_shrink"``,
``"lora_expand"``).

With the compiled kernels (``torch.ops.platform_core_cpu_<level>.lora_shrink`` /
``lora_expand``, ``csrc/lora.cpp``) each token is read with its own slot's weights in place:
no gathered copies of the tokens, no scatter back, the deltas added to the output rows and
rounded once. Expand takes each B transposed (``TransposedWeights``), made once per write of
the slots instead of per call. They run every token but those of segments of at least
``MIN_GEMM_ROWS`` tokens (a prompt's chunk), where torch's GEMMs on the segment's rows are
faster (not so for a slot's many short segments, which would need a gather and a scatter).
They take float32 and bf16; other dtypes, and the torch path (no compiled kernels), run the
torch ops below on every group.

The torch path groups a step's tokens by adapter slot once per step, from the mapping's
segments (no look at ``token_slots``), and the grouping is reused by every projection of the
step (the layers all receive the same ``LoRAMapping`` object). Two ways to run the groups:

- **balanced** short groups (a decode batch: many requests, a token or a few each, spread
  over the adapters) run as one batched GEMM per op (and per part for expand) over the groups
  padded to the largest, gathered and scattered with index tensors built once per step;
- otherwise (a prefill next to a few decodes) each group runs its own GEMMs, on a slice of the
  rows when the group is one segment.

Everything computes in float32 (on the narrow ``S * R`` shrink outputs torch's float32 GEMM,
widening included, beats its bf16 one; small expand GEMMs likewise), except a long segment's
expand into a 16-bit output (``MIN_16BIT_GEMM_ROWS``), which runs 16-bit GEMMs into it. The
per-group path rounds each output row once to the output's dtype, as the reference does; the
batched path adds a 16-bit output its deltas rounded to that dtype (one rounding more, within
the conformance tolerance: torch's mixed-dtype add costs three times the rounding).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from platform_core.backend_api import (
    LoRAMapping,
    check_lora_expand_args,
    check_lora_shrink_args,
)

Rows = slice | torch.Tensor
# Groups run batched when the padding to the largest group is at most this share of the rows
# and no group is longer than ``MAX_BATCHED_ROWS`` (longer groups' own GEMMs are efficient, and
# the batched path's passes over a [tokens, outputs] float32 buffer are not).
MAX_PADDING = 0.5
MAX_BATCHED_ROWS = 64
# A segment of at least this many tokens expands with 16-bit GEMMs into a 16-bit output
# (float32 accumulation; shorter ones widen to float32, where torch's small GEMMs are faster).
MIN_16BIT_GEMM_ROWS = 64
# With the compiled kernels, a segment of at least this many tokens runs torch's GEMMs (the
# kernels are faster below it: ``benchmarks/lora_ops.py``).
MIN_GEMM_ROWS = 128


@dataclass(frozen=True, slots=True)
class SlotGroup:
    """One slot's tokens: a slice when they form one segment, else their indices."""

    slot: int
    rows: Rows
    count: int


@dataclass(frozen=True, slots=True)
class PaddedGroups:
    """The groups as a ``[G, width]`` grid of token indices (padding repeats a real token;
    ``real`` picks the grid positions that are not padding, ``tokens`` their token indices;
    ``grid_of_token`` is each token's grid position, ``G * width`` for the base model's)."""

    slots: torch.Tensor
    grid: torch.Tensor
    real: torch.Tensor
    tokens: torch.Tensor
    grid_of_token: torch.Tensor


@dataclass(frozen=True, slots=True)
class StepGroups:
    """How one step's tokens are grouped by slot. ``long`` are the segments of at least
    ``MIN_GEMM_ROWS`` tokens, as groups; ``short_slots`` is each token's slot for the compiled
    kernels, -1 for the tokens of long segments (``None`` when no token is left)."""

    groups: tuple[SlotGroup, ...]
    padded: PaddedGroups | None
    long: tuple[SlotGroup, ...]
    short_slots: torch.Tensor | None


def group_tokens(mapping: LoRAMapping, device: torch.device) -> StepGroups:
    """The step's slot groups, and the padded grid when the groups are balanced enough."""
    by_slot: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for segment in mapping.segments:
        by_slot[segment.slot].append((segment.start, segment.end))
    groups = []
    indices: list[list[int]] = []
    for slot, spans in by_slot.items():
        tokens = [i for start, end in spans for i in range(start, end)]
        indices.append(tokens)
        rows: Rows = slice(*spans[0])
        if len(spans) > 1:
            rows = torch.tensor(tokens, dtype=torch.int64, device=device)
        groups.append(SlotGroup(slot, rows, len(tokens)))
    total = sum(len(tokens) for tokens in indices)
    width = max((len(tokens) for tokens in indices), default=0)
    padded = None
    balanced = width * len(groups) <= (1 + MAX_PADDING) * total
    if len(groups) > 1 and width <= MAX_BATCHED_ROWS and balanced:
        grid = [tokens + [tokens[0]] * (width - len(tokens)) for tokens in indices]
        grid_of_token = [len(groups) * width] * mapping.num_tokens
        for g, tokens in enumerate(indices):
            for j, token in enumerate(tokens):
                grid_of_token[token] = g * width + j
        real = [g * width + j for g, tokens in enumerate(indices) for j in range(len(tokens))]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        padded = PaddedGroups(
            slots=tensor([group.slot for group in groups]),
            grid=tensor(grid),
            real=tensor(real),
            tokens=tensor([i for tokens in indices for i in tokens]),
            grid_of_token=tensor(grid_of_token),
        )
    long = tuple(
        SlotGroup(segment.slot, slice(segment.start, segment.end), segment.end - segment.start)
        for segment in mapping.segments
        if segment.end - segment.start >= MIN_GEMM_ROWS
    )
    short_slots = None
    if sum(group.count for group in long) < total:
        short_slots = mapping.token_slots.to(device=device, dtype=torch.int32)
        if long:
            short_slots = short_slots.clone()
            for group in long:
                short_slots[group.rows] = -1
        short_slots = short_slots.contiguous()
    return StepGroups(tuple(groups), padded, long, short_slots)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# The compiled expand's B: columns of zeros past the last, and the multiple the width is of.
EXPAND_PADDING, EXPAND_ALIGN = 64, 16


class TransposedWeights:
    """Each ``lora_b`` ``[L, N, R]`` as the compiled expand takes it: ``[L, R, W]`` in its
    dtype, zeros past column N (W: a multiple of ``EXPAND_ALIGN`` at least ``N + EXPAND_PADDING``).

    Kept per tensor and made again when the tensor was written since (its version counter: an
    adapter loaded into a slot writes it in place); tensors without one (made in inference
    mode) are transposed on every call. Entries of tensors gone are dropped as new ones come.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def of(self, lora_b: torch.Tensor) -> torch.Tensor:
        """``lora_b`` transposed (the kept copy while ``lora_b`` is unchanged)."""
        if lora_b.is_inference():
            return _transposed(lora_b)
        entry = self._by_id.get(id(lora_b))
        if entry is not None and entry[0]() is lora_b and entry[1] == lora_b._version:
            return entry[2]
        self._by_id = {k: e for k, e in self._by_id.items() if e[0]() is not None}
        transposed = _transposed(lora_b)
        self._by_id[id(lora_b)] = (weakref.ref(lora_b), lora_b._version, transposed)
        return transposed


def _transposed(lora_b: torch.Tensor) -> torch.Tensor:
    slots, columns, rank = lora_b.shape
    width = (columns + EXPAND_ALIGN - 1) // EXPAND_ALIGN * EXPAND_ALIGN + EXPAND_PADDING
    out = lora_b.new_zeros(slots, rank, width)
    out[:, :, :columns].copy_(lora_b.transpose(1, 2))
    return out


def _kernel_takes(*tensors: torch.Tensor) -> bool:
    return all(t.dtype in _KERNEL_DTYPES and t.device.type == "cpu" for t in tensors)


class CpuLoRAOps:
    """The two ops (``shrink`` and ``expand`` are the op overrides): the compiled kernels of
    ``compiled`` (a ``torch.ops`` namespace, or ``None`` on the torch path) where they take the
    dtypes, else torch ops sharing each step's grouping. The grouping of the last mapping seen
    is kept: the mappings of consecutive steps are different objects, so it is never reused
    across steps."""

    def __init__(self, compiled: Any = None) -> None:
        self._compiled = compiled
        self._last: tuple[LoRAMapping, StepGroups] | None = None
        self._transposed = TransposedWeights()

    def groups(self, mapping: LoRAMapping, device: torch.device) -> StepGroups:
        """The grouping of ``mapping`` (made on first use in a step)."""
        last = self._last
        if last is not None and last[0] is mapping:
            return last[1]
        found = group_tokens(mapping, device)
        self._last = (mapping, found)
        return found

    def shrink(self, x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """``lora_shrink`` (:data:`platform_core.layers.lora.LoRAShrinkFn`)."""
        check_lora_shrink_args(x, lora_a, mapping)
        parts, rank, inputs = lora_a.shape[1:]
        step = self.groups(mapping, x.device)
        if self._compiled is not None and _kernel_takes(x, lora_a):
            rows = torch.empty(x.shape[0], parts * rank, dtype=torch.float32, device=x.device)
            if step.short_slots is None:
                rows.zero_()
            else:
                self._compiled.lora_shrink(
                    x.contiguous(), lora_a.contiguous(), step.short_slots, rows
                )
            for group in step.long:
                _shrink_group(rows, x, lora_a, group)
            return rows.view(x.shape[0], parts, rank).transpose(0, 1)
        rows = torch.zeros(x.shape[0], parts * rank, dtype=torch.float32, device=x.device)
        padded = step.padded
        if padded is not None:
            count, width = padded.grid.shape
            picked = x.index_select(0, padded.grid.view(-1)).view(count, width, inputs).float()
            weights = lora_a.index_select(0, padded.slots).view(count, parts * rank, inputs)
            product = torch.bmm(picked, weights.float().transpose(1, 2))
            real = product.view(count * width, parts * rank).index_select(0, padded.real)
            rows.index_copy_(0, padded.tokens, real)
        else:
            for group in step.groups:
                _shrink_group(rows, x, lora_a, group)
        return rows.view(x.shape[0], parts, rank).transpose(0, 1)

    def expand(
        self,
        out: torch.Tensor,
        buffer: torch.Tensor,
        lora_b: torch.Tensor,
        slice_sizes: tuple[int, ...],
        mapping: LoRAMapping,
    ) -> None:
        """``lora_expand`` (:data:`platform_core.layers.lora.LoRAExpandFn`)."""
        check_lora_expand_args(out, buffer, lora_b, slice_sizes, mapping)
        step = self.groups(mapping, out.device)
        by_token = buffer.transpose(0, 1)  # [T, S, R]
        if (
            self._compiled is not None
            and _kernel_takes(out, lora_b)
            and buffer.dtype == torch.float32
            and out.stride(1) == 1
        ):
            if step.short_slots is not None:
                self._compiled.lora_expand(
                    out,
                    buffer if buffer.stride(2) == 1 else buffer.contiguous(),
                    self._transposed.of(lora_b),
                    step.short_slots,
                    list(slice_sizes),
                )
            for group in step.long:
                _expand_group(out, by_token, lora_b, slice_sizes, group)
            return
        padded = step.padded
        if padded is not None:
            count, width = padded.grid.shape
            picked = by_token.index_select(0, padded.grid.view(-1)).float()
            picked = picked.view(count, width, *by_token.shape[1:])
            weights = lora_b.index_select(0, padded.slots).float()
            # The grid's deltas, then a zero row that tokens of the base model read.
            deltas = out.new_empty(count * width + 1, out.shape[1], dtype=torch.float32)
            deltas[-1] = 0
            for part, start, size in _parts(slice_sizes):
                product = torch.bmm(picked[:, :, part], weights[:, start : start + size].mT)
                deltas[:-1, start : start + size] = product.view(count * width, size)
            # In token order; a 16-bit output adds the deltas rounded to its dtype (torch's
            # mixed-dtype add is three times slower than rounding first).
            out.add_(deltas.index_select(0, padded.grid_of_token).to(out.dtype))
            return
        for group in step.groups:
            _expand_group(out, by_token, lora_b, slice_sizes, group)


def _shrink_group(
    rows: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, group: SlotGroup
) -> None:
    """``rows[group's tokens] = x[those tokens] @ A[slot].T`` (``rows`` float32 ``[T, S * R]``)."""
    weights = lora_a[group.slot].reshape(rows.shape[1], lora_a.shape[3]).float()
    rows[group.rows] = _rows_of(x, group.rows).float() @ weights.T


def _expand_group(
    out: torch.Tensor,
    by_token: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: tuple[int, ...],
    group: SlotGroup,
) -> None:
    """Add the deltas of ``group``'s tokens to their rows of ``out`` (``by_token`` is the shrink
    buffer as ``[T, S, R]``)."""
    in_place = out.dtype == torch.float32 or group.count >= MIN_16BIT_GEMM_ROWS
    if in_place and isinstance(group.rows, slice):
        # One segment: GEMMs straight into out's rows, in its dtype.
        weights = lora_b[group.slot].to(out.dtype)
        picked = by_token[group.rows].to(out.dtype)
        for part, start, size in _parts(slice_sizes):
            target = out[group.rows, start : start + size]
            target.addmm_(picked[:, part], weights[start : start + size].T)
        return
    weights = lora_b[group.slot].float()
    picked = _rows_of(by_token, group.rows).float()
    deltas = torch.cat(
        [
            picked[:, part] @ weights[start : start + size].T
            for part, start, size in _parts(slice_sizes)
        ],
        dim=1,
    )
    _add_rows(out, group.rows, deltas)


def _parts(slice_sizes: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(part, first output column, size)`` of each part."""
    starts = [0]
    for size in slice_sizes[:-1]:
        starts.append(starts[-1] + size)
    return [(part, start, size) for part, (start, size) in enumerate(zip(starts, slice_sizes))]


def _rows_of(tensor: torch.Tensor, rows: Rows) -> torch.Tensor:
    return tensor[rows] if isinstance(rows, slice) else tensor.index_select(0, rows)


def _add_rows(out: torch.Tensor, rows: Rows, deltas: torch.Tensor) -> None:
    """``out[rows] += deltas`` (float32), each row rounded once to ``out``'s dtype."""
    if out.dtype == torch.float32:
        if isinstance(rows, slice):
            out[rows] += deltas
        else:
            out.index_add_(0, rows, deltas)
        return
    summed = (_rows_of(out, rows).float() + deltas).to(out.dtype)
    if isinstance(rows, slice):
        out[rows] = summed
    else:
        out.index_copy_(0, rows, summed)
