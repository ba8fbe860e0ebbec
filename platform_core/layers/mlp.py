"""The gated (SwiGLU) feed-forward block of Llama-family models."""

from __future__ import annotations

import torch
from torch import nn

from platform_core.layers.activation import SiluAndMulFn
from platform_core.layers.linear import Linear


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``gate_up_proj`` matmul."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        act: SiluAndMulFn,
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(
            hidden_size,
            (intermediate_size, intermediate_size),
            bias,
            dtype,
            checkpoint_parts=("gate_proj", "up_proj"),
        )
        self.down_proj = Linear(intermediate_size, (hidden_size,), bias, dtype)
        self._act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._act(self.gate_up_proj(x)))
