"""Which LoRA slot each token of a step runs with, and the signatures of the LoRA ops.

A layer with LoRA holds the weights of up to ``max_loras`` adapters stacked by *slot*: for a
linear fused from ``S`` checkpoint projections (q/k/v: 3, gate/up: 2, else 1),
``lora_a[slot, s]`` is ``[R, in]`` (part ``s``'s A, zero-padded to the engine's
``max_lora_rank`` R) and ``lora_b[slot]`` is ``[N, R]`` (every part's B stacked along the
output rows in part order, scaling folded in). A step's :class:`LoRAMapping` gives each token's
slot (-1: the base model, no delta). The projection with LoRA is::

    buffer = lora_shrink(x, lora_a, mapping)              # [S, T, R] float32
    lora_expand(out, buffer, lora_b, slice_sizes, mapping)  # out[:, part s] += buffer[s] @ B_s.T
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoRASegment:
    """Tokens ``[start, end)`` of the step all run with adapter slot ``slot`` (never -1)."""

    start: int
    end: int
    slot: int


@dataclass(frozen=True, slots=True)
class LoRAMapping:
    """One step's tokens and their adapter slots.

    ``token_slots`` (``[T]`` int32, on the model's device) is each token's slot, -1 for tokens
    of the base model. ``segments`` (host) are the maximal runs of consecutive tokens with the
    same slot other than -1, in token order: a request's tokens are consecutive, so a step has
    at most one segment per request. ``max_slots`` is the number of slots the layers hold.
    """

    token_slots: torch.Tensor
    segments: tuple[LoRASegment, ...]
    max_slots: int

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.shape[0])

    @property
    def has_adapters(self) -> bool:
        """Whether any token of the step runs with an adapter."""
        return bool(self.segments)


# ``(x [T, in], lora_a [L, S, R, in], mapping) -> buffer [S, T, R]`` float32, zero rows for
# tokens of slot -1.
LoRAShrinkFn = Callable[[torch.Tensor, torch.Tensor, LoRAMapping], torch.Tensor]
# ``(out [T, N], buffer [S, T, R], lora_b [L, N, R], slice_sizes, mapping) -> None``: adds
# ``buffer[s, t] @ lora_b[slot(t), rows of part s].T`` to ``out[t, rows of part s]`` in place,
# in ``out``'s dtype, for every token ``t`` with a slot; ``sum(slice_sizes) == N``.
LoRAExpandFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...], LoRAMapping], None
]
