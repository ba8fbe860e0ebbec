"""Choosing the draft proposer named by the speculative config."""

from __future__ import annotations

from typing import Protocol

from platform_core.config import SpeculativeConfig
from platform_core.errors import ConfigError
from platform_core.spec.ngram import NgramProposer


class Proposer(Protocol):
    """Proposes draft tokens continuing a sequence."""

    def propose(self, token_ids: list[int], limit: int) -> list[int]: ...


def build_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The proposer for ``config``, or ``None`` when speculation is off."""
    if config.speculative_method is None:
        return None
    if config.speculative_method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    raise ConfigError(
        f"speculative_method={config.speculative_method!r} is not available yet; use 'ngram'"
    )
