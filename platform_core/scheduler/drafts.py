"""Speculative decoding's share of scheduling: drafts are proposed for decoding requests, fit
into the step's token budget, ride along for one step, and are settled once verified.

The proposer (a model, or prompt lookup) is handed in: the scheduler never imports it.
"""

from __future__ import annotations

from typing import Any, Protocol

from platform_core.kv_cache.manager import KVCacheManager
from platform_core.scheduler.request import Request
from platform_core.scheduler.stats import SchedulerStats


class DraftProposer(Protocol):
    """Sets ``spec_token_ids`` (at most ``limits[i]`` tokens) of each request and, for a proposer
    that samples, ``spec_draft_probs``; it may claim the next step's slots through ``kv``."""

    def propose(self, requests: list[Request], limits: list[int], kv: KVCacheManager) -> None: ...


def propose_drafts(
    proposer: DraftProposer,
    running: list[Request],
    kv: KVCacheManager,
    max_model_len: int,
    disable_at: int | None,
) -> None:
    """Drafts for every running request that is decoding (one token uncomputed, no forks
    pending), none once ``disable_at`` or more are decoding."""
    decoding = [
        r for r in running if r.num_tokens - r.num_computed_tokens == 1 and not r.pending_fork_ids
    ]
    if disable_at is not None and len(decoding) >= disable_at:
        return  # batched decode is not latency-bound: drafts would cost more than they save
    limits = [
        min(r.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens - 1)
        for r in decoding
    ]
    proposer.propose(decoding, limits, kv)


def fit_drafts(request: Request, num_uncomputed: int, budget: int) -> int:
    """Keep the drafts that fit with the request's next token in ``budget``; how many.

    Drafts only follow a decode (one token uncomputed); a prefill chunk drops them.
    """
    fits = num_uncomputed == 1 and budget > 1
    request.spec_token_ids = request.spec_token_ids[: budget - 1] if fits else []
    return len(request.spec_token_ids)


def take_drafts(request: Request) -> tuple[list[int], Any]:
    """Remove the request's drafts for this step: the tokens and their distributions."""
    drafts, probs = request.spec_token_ids, request.spec_draft_probs
    request.spec_token_ids, request.spec_draft_probs = [], None
    return drafts, None if probs is None else probs[: len(drafts)]


def settle_drafts(
    request: Request,
    num_drafts: int,
    tokens: list[int] | None,
    kv: KVCacheManager,
    stats: SchedulerStats,
) -> None:
    """After a step that verified ``num_drafts`` drafts (``tokens``: those accepted plus one):
    the rejected drafts' KV is garbage, neither counted as computed nor kept in blocks."""
    rejected = num_drafts - (len(tokens) - 1) if tokens else 0
    request.num_computed_tokens -= rejected
    stats.record_verification(num_drafts, rejected)
    if rejected:
        kv.trim(request)
