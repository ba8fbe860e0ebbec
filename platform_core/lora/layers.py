"""LoRA adapter slots on a model's projections, and the per-step mapping they read.

``attach_lora`` gives every targetable linear of a Llama-family model a :class:`LinearLoRA`
(its ``delta``): ``max_loras`` slots of stacked A and B weights of this rank's shard, zero
until an adapter is written into a slot. All of a model's ``LinearLoRA`` share one
:class:`LoRAStepState`, which the model runner points at each step's :class:`LoRAMapping`
before the forward pass.

Tensor parallelism shards an adapter like its base layer: for a column-parallel linear A is
whole and B keeps this rank's output rows of each part; for a row-parallel linear A keeps this
rank's input columns and B is whole, and the partial delta joins the partial output before the
layer's all-reduce, which sums both (``x W^T + x A^T B^T`` is linear in the input columns).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from platform_core.layers.linear import ColumnParallelLinear, QuantizableLinear, RowParallelLinear
from platform_core.layers.lora_mapping import LoRAExpandFn, LoRAMapping, LoRAShrinkFn

# The fused projections of our models and the checkpoint projections they stack, in order.
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_SINGLE = ("o_proj", "down_proj")

#: ``(A [r, in], B [out, r])`` full (unsharded) weights of one checkpoint projection
ModuleWeights = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class LoRAStepState:
    """The mapping of the step being run (``None``: no token runs with an adapter)."""

    mapping: LoRAMapping | None = None


class LinearLoRA:
    """The adapter slots of one linear: ``lora_a [L, S, R, in]``, ``lora_b [L, N, R]``."""

    def __init__(
        self,
        linear: QuantizableLinear,
        parts: tuple[str, ...],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        state: LoRAStepState,
        shrink: LoRAShrinkFn,
        expand: LoRAExpandFn,
    ) -> None:
        self.parts = parts
        self.state = state
        self._shrink = shrink
        self._expand = expand
        device = linear.weight.device
        if isinstance(linear, ColumnParallelLinear):
            self.input_columns = slice(0, linear.in_features)
            self.output_rows = tuple(
                slice(s.start, s.start + s.length) for s in linear.output_shards
            )
        elif isinstance(linear, RowParallelLinear):
            shard = linear.input_shard
            self.input_columns = slice(shard.start, shard.start + shard.length)
            self.output_rows = (slice(0, linear.weight.shape[0]),)
        else:
            raise TypeError(f"no LoRA for {type(linear).__name__}")
        self.slice_sizes = tuple(rows.stop - rows.start for rows in self.output_rows)
        in_local = self.input_columns.stop - self.input_columns.start
        self.lora_a = torch.zeros(
            max_loras, len(parts), max_rank, in_local, dtype=dtype, device=device
        )
        self.lora_b = torch.zeros(
            max_loras, sum(self.slice_sizes), max_rank, dtype=dtype, device=device
        )

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add each token's adapter delta to ``out`` (nothing for base-model tokens)."""
        mapping = self.state.mapping
        if mapping is None:
            return
        buffer = self._shrink(x, self.lora_a, mapping)
        self._expand(out, buffer, self.lora_b, self.slice_sizes, mapping)

    def write_slot(self, slot: int, weights: Mapping[str, ModuleWeights]) -> None:
        """Fill ``slot`` with this rank's shard of the adapter's ``weights`` by checkpoint
        projection name; parts the adapter does not target get zeros."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        row = 0
        for index, (part, rows) in enumerate(zip(self.parts, self.output_rows, strict=True)):
            size = rows.stop - rows.start
            found = weights.get(part)
            if found is not None:
                a, b = found
                rank = a.shape[0]
                self.lora_a[slot, index, :rank].copy_(a[:, self.input_columns])
                self.lora_b[slot, row : row + size, :rank].copy_(b[rows])
            row += size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.lora_a, self.lora_b))


def lora_targets(model: nn.Module) -> Iterator[tuple[int, tuple[str, ...], QuantizableLinear]]:
    """``(layer index, checkpoint parts, linear)`` of every projection LoRA can target."""
    for index, layer in enumerate(model.model.layers):
        for module_name, module in layer.named_modules():
            leaf = module_name.rsplit(".", 1)[-1]
            if leaf in _FUSED_PARTS:
                yield index, _FUSED_PARTS[leaf], module
            elif leaf in _SINGLE:
                yield index, (leaf,), module


def attach_lora(
    model: nn.Module,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    shrink: LoRAShrinkFn,
    expand: LoRAExpandFn,
) -> tuple[LoRAStepState, dict[int, list[LinearLoRA]]]:
    """Give every targetable projection of ``model`` slots in ``dtype`` (the activations');
    the shared step state and each decoder layer's ``LinearLoRA``s."""
    state = LoRAStepState()
    by_layer: dict[int, list[LinearLoRA]] = {}
    for index, parts, linear in list(lora_targets(model)):
        lora = LinearLoRA(linear, parts, max_loras, max_rank, dtype, state, shrink, expand)
        linear.delta = lora
        by_layer.setdefault(index, []).append(lora)
    return state, by_layer
