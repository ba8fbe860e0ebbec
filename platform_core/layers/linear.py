"""Linear projections split over tensor-parallel ranks by output rows or by input columns.

Both hold only this rank's part of the weight and declare (``placements``) which part of which
checkpoint tensor fills it; with a single rank the shards are whole and nothing communicates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from platform_core.distributed.parallel_state import TPGroup
from platform_core.layers.module import LayerModule
from platform_core.layers.sharding import Placement, Shard

# ``F.linear``'s signature: ``(x, weight, bias) -> x @ weight.T (+ bias)``.
LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class ColumnParallelLinear(LayerModule):
    """``y = x @ weight.T (+ bias)`` producing this rank's output rows; no communication.

    ``output_shards`` gives, per stacked checkpoint projection, the rows this rank holds. With
    ``checkpoint_parts`` (``("q_proj", "k_proj", "v_proj")`` fills a fused ``qkv_proj``) each part
    loads from the sibling checkpoint module of that name and the output is the concatenation of
    the parts' local rows, in order; with no parts the weight loads from the module's own name.
    """

    def __init__(
        self,
        input_size: int,
        output_shards: Sequence[Shard],
        bias: bool,
        dtype: torch.dtype,
        checkpoint_parts: Sequence[str] = (),
        linear: LinearFn = F.linear,
    ) -> None:
        super().__init__()
        if len(output_shards) != (len(checkpoint_parts) or 1):
            raise ValueError("need one output shard per checkpoint part (one without parts)")
        self.output_shards = tuple(output_shards)
        self.output_sizes = tuple(shard.length for shard in self.output_shards)
        self.checkpoint_parts = tuple(checkpoint_parts)
        out = sum(self.output_sizes)
        self.weight = _parameter(out, input_size, dtype=dtype)
        self.bias = _parameter(out, dtype=dtype) if bias else None
        self._linear = linear

    def placements(self, param_name: str) -> tuple[Placement, ...]:
        """One row placement per part, stacked in order (weight and bias alike)."""
        starts = [0]
        for size in self.output_sizes[:-1]:
            starts.append(starts[-1] + size)
        return tuple(Placement(0, shard, start) for shard, start in zip(self.output_shards, starts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        parts = f", parts={self.checkpoint_parts}" if self.checkpoint_parts else ""
        return (
            f"in={self.weight.shape[1]}, out={self.output_sizes}, "
            f"bias={self.bias is not None}{parts}"
        )


class RowParallelLinear(LayerModule):
    """``y = sum over ranks(x_r @ weight_r.T) (+ bias)``: ``x`` holds this rank's input columns.

    The partial products are summed with one all-reduce; the bias is added once, after it.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TPGroup,
        linear: LinearFn = F.linear,
    ) -> None:
        super().__init__()
        start, length = tp.shard_range(input_size)
        self.input_shard = Shard(start, length, input_size)
        self.weight = _parameter(output_size, length, dtype=dtype)
        self.bias = _parameter(output_size, dtype=dtype) if bias else None
        self._communicator = tp.communicator if tp.is_parallel else None
        self._linear = linear

    def placements(self, param_name: str) -> tuple[Placement, ...]:
        """The weight's input columns are sharded; the bias is replicated."""
        if param_name == "bias":
            return (Placement(0, Shard.whole(self.weight.shape[0])),)
        return (Placement(1, self.input_shard),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._communicator is None:
            return self._linear(x, self.weight, self.bias)
        out = self._communicator.all_reduce(self._linear(x, self.weight, None))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        shard = self.input_shard
        return (
            f"in={shard.start}:{shard.start + shard.length} of {shard.full}, "
            f"out={self.weight.shape[0]}, bias={self.bias is not None}"
        )
