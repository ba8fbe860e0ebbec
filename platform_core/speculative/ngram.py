"""Prompt-lookup proposals: continue the sequence the way it continued after an earlier match.

The last ``n`` tokens (``n`` from ``ngram_max`` down to ``ngram_min``) are searched for earlier in
the sequence (prompt and output); the tokens that followed the most recent earlier occurrence
are proposed. No model runs, so a miss costs almost nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from platform_core.kv_cache.manager import KVCacheManager
    from platform_core.scheduler.request import Request


class NgramProposer:
    """Proposes up to ``num_tokens`` drafts per sequence by n-gram matching."""

    def __init__(self, num_tokens: int, ngram_min: int, ngram_max: int) -> None:
        self.num_tokens = num_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    bytes_per_block = 0

    def propose(self, requests: list[Request], limits: list[int], kv: KVCacheManager) -> None:
        """Set each request's ``spec_token_ids`` (no model runs, no blocks are claimed)."""
        for request, limit in zip(requests, limits):
            request.spec_token_ids = self.propose_for(request.all_token_ids, limit)

    def propose_for(self, token_ids: list[int], limit: int) -> list[int]:
        """At most ``min(limit, num_tokens)`` draft tokens continuing ``token_ids``."""
        count = min(limit, self.num_tokens)
        if count <= 0 or len(token_ids) < self.ngram_min + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            start = self._last_match(tokens, n)
            if start is not None:
                follow = tokens[start + n : start + n + count]
                return follow.tolist()
        return []

    @staticmethod
    def _last_match(tokens: np.ndarray, n: int) -> int | None:
        """Start of the most recent earlier occurrence of the last ``n`` tokens, if any."""
        suffix = tokens[-n:]
        # Candidate windows start at 0 .. len - n - 1 (the suffix itself is excluded).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        return int(hits[-1]) if hits.size else None
