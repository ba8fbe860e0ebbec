"""The proposer interface and choosing the one the speculative config names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from platform_core.config import EngineConfig
from platform_core.scheduler.drafts import DraftProposer
from platform_core.speculative.ngram import NgramProposer

if TYPE_CHECKING:
    from platform_core.plugins.interfaces import Backend


class Proposer(DraftProposer, Protocol):
    """Proposes draft tokens for decoding requests before each step (``DraftProposer``);
    ``bytes_per_block`` is the KV memory it needs per pool block."""

    bytes_per_block: int


def build_proposer(
    config: EngineConfig, backend: Backend, dtype: torch.dtype, vocab_size: int
) -> Proposer | None:
    """The proposer for ``config``, or ``None`` when speculation is off."""
    spec = config.speculative
    if spec.speculative_method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max)
    if spec.speculative_method == "draft":
        from platform_core.speculative.draft_model import DraftModelProposer

        return DraftModelProposer(config, backend, dtype, vocab_size)
    return None
