"""The logprobs record the sampler produces and the scheduler's messages carry (no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class TokenLogprobs:
    """Raw log-probabilities at one position: the chosen token's, its rank, and the top ones."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]
