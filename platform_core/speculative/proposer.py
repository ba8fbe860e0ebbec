"""The proposer interface and choosing the one the speculative config names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from platform_core.config import EngineConfig
from platform_core.speculative.ngram import NgramProposer

if TYPE_CHECKING:
    from platform_core.kv_cache.manager import KVCacheManager
    from platform_core.plugins.interfaces import Backend
    from platform_core.scheduler.request import Request


class Proposer(Protocol):
    """Proposes draft tokens for decoding requests before each step.

    ``propose`` sets ``spec_token_ids`` (at most ``limits[i]`` tokens) and, for a proposer that
    samples, ``spec_draft_probs``. ``bytes_per_block`` is the KV memory it needs per pool block.
    """

    bytes_per_block: int

    def propose(self, requests: list[Request], limits: list[int], kv: KVCacheManager) -> None: ...


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
