"""Root-mean-square layer norm (the Llama family's only norm)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from platform_core.layers.module import LayerModule

RmsNormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
"""``rms_norm(x, weight, eps) -> Tensor``: normalizes the last dim of ``x`` (2-D activations, or
3-D ``[T, heads, head_size]`` for per-head q/k norms); returns a new tensor in ``x``'s dtype and
leaves ``x`` untouched."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Default RMS norm: statistics in float32, scaled by ``weight`` in ``x``'s dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(LayerModule):
    """RMS norm over the last dimension with a learned per-channel ``weight``."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, op: RmsNormFn) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self._op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
