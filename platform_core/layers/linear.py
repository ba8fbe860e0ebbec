"""Linear projections split over tensor-parallel ranks by output rows or by input columns.

Both hold only this rank's part of the weight and declare (``placements``) which part of which
checkpoint tensor fills it; with a single rank the shards are whole and nothing communicates.
Either may keep its weight quantized (:meth:`QuantizableLinear.keep_quantized`): the weight is
then the rows' blocks as stored (:mod:`platform_core.quantization.formats`), sharded by rows or
by whole blocks of columns, and the forward runs the ``quantized_linear`` op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from platform_core.distributed.parallel_state import TPGroup
from platform_core.layers.module import LayerModule
from platform_core.layers.sharding import Placement, Shard
from platform_core.quantization.formats import QuantFormat, QuantizedLinearFn, quantized_linear

# ``F.linear``'s signature: ``(x, weight, bias) -> x @ weight.T (+ bias)``.
LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class OutputDelta(Protocol):
    """Something a linear adds to its output (LoRA adapters: ``platform_core.lora.layers``)."""

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the delta of input ``x`` (``[T, in]``) to the projection ``out`` in place."""
        ...


def _parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class QuantizableWeight(LayerModule):
    """A layer whose ``[rows, columns]`` weight may be kept in a block format instead."""

    weight: nn.Parameter
    #: the format the weight is kept in, or None for a 16/32-bit weight
    quant: QuantFormat | None = None

    def keep_quantized(self, fmt: QuantFormat) -> None:
        """Hold the weight as ``fmt`` blocks (``uint8 [rows, row_bytes]``, zero until loaded:
        zero blocks are zero weights)."""
        rows, columns = self.weight.shape
        blocks = torch.zeros(
            rows, fmt.row_bytes(columns), dtype=torch.uint8, device=self.weight.device
        )
        self.weight = nn.Parameter(blocks, requires_grad=False)
        self.quant = fmt

    def _quant_repr(self) -> str:
        return "" if self.quant is None else f", quant={self.quant.name}"


class QuantizableLinear(QuantizableWeight):
    """What both linears share: the projection through the 16/32-bit or the quantized op."""

    _linear: LinearFn
    _quantized_linear: QuantizedLinearFn
    #: added to every output (before a row-parallel all-reduce): the LoRA adapters, if any
    delta: OutputDelta | None = None

    @property
    def in_features(self) -> int:
        """This rank's input columns."""
        columns = self.weight.shape[1]
        return columns if self.quant is None else self.quant.in_features(columns)

    def _project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is None:
            out = self._linear(x, self.weight, bias)
        else:
            out = self._quantized_linear(x, self.weight, self.quant, bias)
        if self.delta is not None:
            self.delta.add_to(x, out)
        return out


class ColumnParallelLinear(QuantizableLinear):
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
        quantized: QuantizedLinearFn = quantized_linear,
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
        self._quantized_linear = quantized

    def placements(self, param_name: str) -> tuple[Placement, ...]:
        """One row placement per part, stacked in order (weight and bias alike)."""
        starts = [0]
        for size in self.output_sizes[:-1]:
            starts.append(starts[-1] + size)
        return tuple(Placement(0, shard, start) for shard, start in zip(self.output_shards, starts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._project(x, self.bias)

    def extra_repr(self) -> str:
        parts = f", parts={self.checkpoint_parts}" if self.checkpoint_parts else ""
        return (
            f"in={self.in_features}, out={self.output_sizes}, "
            f"bias={self.bias is not None}{parts}{self._quant_repr()}"
        )


class RowParallelLinear(QuantizableLinear):
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
        quantized: QuantizedLinearFn = quantized_linear,
    ) -> None:
        super().__init__()
        start, length = tp.shard_range(input_size)
        self.input_shard = Shard(start, length, input_size)
        self.weight = _parameter(output_size, length, dtype=dtype)
        self.bias = _parameter(output_size, dtype=dtype) if bias else None
        self._communicator = tp.communicator if tp.is_parallel else None
        self._linear = linear
        self._quantized_linear = quantized

    def keep_quantized(self, fmt: QuantFormat) -> None:
        """As :meth:`QuantizableLinear.keep_quantized`; this rank's columns must be whole
        blocks of ``fmt`` (a ValueError says which shard is not)."""
        shard = self.input_shard
        if shard.start % fmt.block_size or shard.length % fmt.block_size:
            raise ValueError(
                f"input columns {shard.start}:{shard.start + shard.length} of {shard.full} are "
                f"not whole {fmt.name} blocks of {fmt.block_size}"
            )
        super().keep_quantized(fmt)

    def placements(self, param_name: str) -> tuple[Placement, ...]:
        """The weight's input columns are sharded (whole blocks, in bytes, when quantized);
        the bias is replicated."""
        if param_name == "bias":
            return (Placement(0, Shard.whole(self.weight.shape[0])),)
        shard, fmt = self.input_shard, self.quant
        if fmt is None:
            return (Placement(1, shard),)
        # FP8 rows (a scale, then one byte a column) are never read as bytes: the loader maps
        # this back to columns (in_features) and quantizes or copies the codes itself.
        columns = Shard(fmt.row_bytes(shard.start), self.weight.shape[1], fmt.row_bytes(shard.full))
        return (Placement(1, columns),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._communicator is None:
            return self._project(x, self.bias)
        out = self._communicator.all_reduce(self._project(x, None))
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        shard = self.input_shard
        return (
            f"in={shard.start}:{shard.start + shard.length} of {shard.full}, "
            f"out={self.weight.shape[0]}, bias={self.bias is not None}{self._quant_repr()}"
        )
