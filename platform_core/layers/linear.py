"""Linear projections, optionally stacking several checkpoint projections into one matmul."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)`` whose output is the concatenation of ``output_sizes``.

    When ``checkpoint_parts`` is given, the output rows are assembled at load time from the
    sibling checkpoint modules of those names, in order (``("q_proj", "k_proj", "v_proj")`` fills a
    fused ``qkv_proj``); the loader reads ``output_sizes`` to place each part. With no parts the
    weight loads from the module's own name.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        checkpoint_parts: Sequence[str] = (),
    ) -> None:
        super().__init__()
        if checkpoint_parts and len(checkpoint_parts) != len(output_sizes):
            raise ValueError("checkpoint_parts and output_sizes must have the same length")
        self.output_sizes = tuple(output_sizes)
        self.checkpoint_parts = tuple(checkpoint_parts)
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        parts = f", parts={self.checkpoint_parts}" if self.checkpoint_parts else ""
        return (
            f"in={self.weight.shape[1]}, out={self.output_sizes}, "
            f"bias={self.bias is not None}{parts}"
        )
