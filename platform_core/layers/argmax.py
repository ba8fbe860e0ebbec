"""Row argmax: the sampler's greedy pick, an op a backend may override (``"argmax"``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

ArgmaxFn = Callable[[torch.Tensor], torch.Tensor]
"""``argmax(x) -> Tensor``: ``torch.argmax(x, dim=-1)`` of ``[rows, vocab]`` logits, float32 or
the model's narrower dtype (the first maximal index; a NaN counts as maximal), int64 ``[rows]``."""


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Default argmax op: torch's."""
    return x.argmax(dim=-1)
