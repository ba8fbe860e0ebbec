"""Token embedding table, also usable as the (tied) output projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """Looks up ``[num_tokens]`` ids in a ``[vocab_size, hidden_size]`` table."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


def logits_from_hidden(hidden: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
    """``[N, hidden] -> [N, vocab]`` in float32; the matmul runs in the model's dtype."""
    return F.linear(hidden, lm_weight).float()
