"""LoRA shrink and expand: the core's reference ops (``"lora_shrink"``, ``"lora_expand"``), which
a backend may override (since plugin API 1.6).

The references are the oracle of the conformance checks: float32 math on the inputs as given,
one adapter slot at a time (the tokens of that slot picked by a mask over ``token_slots``, the
truth on the device; ``segments`` only says whether any token has a slot), so no per-token copy
of the adapter weights is ever made. Signatures and layouts:
:mod:`platform_core.layers.lora_mapping`.
"""

from __future__ import annotations

import torch

from platform_core.layers.lora_mapping import (
    LoRAExpandFn,
    LoRAMapping,
    LoRASegment,
    LoRAShrinkFn,
)

__all__ = [
    "LoRAExpandFn",
    "LoRAMapping",
    "LoRASegment",
    "LoRAShrinkFn",
    "check_lora_expand_args",
    "check_lora_shrink_args",
    "lora_expand",
    "lora_shrink",
]


def check_lora_shrink_args(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> None:
    """Raise ``ValueError`` naming the mismatch unless the shapes fit :data:`LoRAShrinkFn`."""
    if x.dim() != 2 or lora_a.dim() != 4:
        raise ValueError(
            f"lora_shrink: x must be [T, in] and lora_a [L, S, R, in], got {tuple(x.shape)} "
            f"and {tuple(lora_a.shape)}"
        )
    if lora_a.shape[3] != x.shape[1]:
        raise ValueError(f"lora_shrink: lora_a's input size {lora_a.shape[3]} != x's {x.shape[1]}")
    if mapping.num_tokens != x.shape[0]:
        raise ValueError(
            f"lora_shrink: the mapping has {mapping.num_tokens} tokens, x has {x.shape[0]}"
        )


def check_lora_expand_args(
    out: torch.Tensor,
    buffer: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: tuple[int, ...],
    mapping: LoRAMapping,
) -> None:
    """Raise ``ValueError`` naming the mismatch unless the shapes fit :data:`LoRAExpandFn`."""
    if out.dim() != 2 or buffer.dim() != 3 or lora_b.dim() != 3:
        raise ValueError(
            f"lora_expand: out must be [T, N], buffer [S, T, R] and lora_b [L, N, R], got "
            f"{tuple(out.shape)}, {tuple(buffer.shape)} and {tuple(lora_b.shape)}"
        )
    if len(slice_sizes) != buffer.shape[0] or sum(slice_sizes) != out.shape[1]:
        raise ValueError(
            f"lora_expand: slice_sizes {slice_sizes} must have one size per buffer part "
            f"({buffer.shape[0]}) summing to out's {out.shape[1]} columns"
        )
    if lora_b.shape[1] != out.shape[1] or lora_b.shape[2] != buffer.shape[2]:
        raise ValueError(
            f"lora_expand: lora_b {tuple(lora_b.shape)} does not fit out's {out.shape[1]} "
            f"columns and the buffer's rank {buffer.shape[2]}"
        )
    if not mapping.num_tokens == out.shape[0] == buffer.shape[1]:
        raise ValueError(
            f"lora_expand: the mapping has {mapping.num_tokens} tokens, out {out.shape[0]} and "
            f"the buffer {buffer.shape[1]}"
        )


def _tokens_by_slot(mapping: LoRAMapping) -> list[tuple[int, torch.Tensor]]:
    """Each slot some token runs with, and the indices of its tokens (on the device)."""
    slots = mapping.token_slots
    return [
        (slot, (slots == slot).nonzero().squeeze(1))
        for slot in torch.unique(slots[slots >= 0]).tolist()
    ]


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
    """Default LoRA shrink (:data:`LoRAShrinkFn`): ``buffer[s, t] = lora_a[slot(t), s] @ x[t]``
    in float32, zero for tokens of slot -1."""
    check_lora_shrink_args(x, lora_a, mapping)
    parts, rank = lora_a.shape[1], lora_a.shape[2]
    buffer = torch.zeros(parts, x.shape[0], rank, dtype=torch.float32, device=x.device)
    if not mapping.has_adapters:
        return buffer
    for slot, tokens in _tokens_by_slot(mapping):
        # [n, in] x [S, R, in] -> [S, n, R]
        buffer[:, tokens] = torch.einsum("ti,sri->str", x[tokens].float(), lora_a[slot].float())
    return buffer


def lora_expand(
    out: torch.Tensor,
    buffer: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: tuple[int, ...],
    mapping: LoRAMapping,
) -> None:
    """Default LoRA expand (:data:`LoRAExpandFn`): ``out[t, part s] += buffer[s, t] @
    lora_b[slot(t), part s].T`` for tokens with a slot, summed in float32 and rounded once to
    ``out``'s dtype."""
    check_lora_expand_args(out, buffer, lora_b, slice_sizes, mapping)
    if not mapping.has_adapters:
        return
    for slot, tokens in _tokens_by_slot(mapping):
        rows = out[tokens].float()
        weights = lora_b[slot].float()
        start = 0
        for part, size in enumerate(slice_sizes):
            rows[:, start : start + size] += (
                buffer[part, tokens].float() @ weights[start : start + size].T
            )
            start += size
        out[tokens] = rows.to(out.dtype)
