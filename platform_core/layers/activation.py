"""Gated activations."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

SiluAndMulFn = Callable[[torch.Tensor], torch.Tensor]
"""``silu_and_mul(x) -> Tensor``: ``x`` is ``[..., 2 * d]`` (gate then up); returns
``silu(gate) * up`` of shape ``[..., d]`` as a new tensor."""


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Default SwiGLU activation on a fused ``[gate | up]`` tensor."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
