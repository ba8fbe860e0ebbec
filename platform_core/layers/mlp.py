"""The gated (SwiGLU) feed-forward block of Llama-family models."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from platform_core.distributed.parallel_state import TPGroup
from platform_core.layers.activation import SiluAndMulFn
from platform_core.layers.linear import ColumnParallelLinear, LinearFn, RowParallelLinear
from platform_core.layers.module import LayerModule
from platform_core.layers.sharding import Shard
from platform_core.quantization.formats import QuantizedLinearFn, quantized_linear


class GatedMLP(LayerModule):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``gate_up_proj`` matmul.

    Under tensor parallelism each rank holds a slice of the intermediate features (the same
    slice of gate and of up), and ``down_proj`` sums the ranks' partial outputs.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        act: SiluAndMulFn,
        tp: TPGroup,
        linear: LinearFn = F.linear,
        quantized: QuantizedLinearFn = quantized_linear,
    ) -> None:
        super().__init__()
        shard = Shard(*tp.shard_range(intermediate_size, "intermediate_size"), intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size,
            (shard, shard),
            bias,
            dtype,
            checkpoint_parts=("gate_proj", "up_proj"),
            linear=linear,
            quantized=quantized,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, dtype, tp, linear=linear, quantized=quantized
        )
        self._act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act(self.gate_up_proj(x)))
