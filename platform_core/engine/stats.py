"""The flat counters ``LLMEngine.stats()`` reports (and the server's metrics read)."""

from __future__ import annotations

from typing import Any

from platform_core.scheduler.scheduler import Scheduler
from platform_core.scheduler.stats import STEP_TOKEN_BUCKETS

# Flat keys (summed as they are across data-parallel replicas): steps of more tokens than the
# previous bound and at most this one (not cumulative: cheap to report after every step).
STEP_BUCKET_KEYS = tuple(f"num_steps_to_{bound}_tokens" for bound in STEP_TOKEN_BUCKETS)


def engine_stats(scheduler: Scheduler) -> dict[str, Any]:
    """Preemptions, prefix-cache tokens, KV blocks, steps (their sizes under
    ``STEP_BUCKET_KEYS``), speculation and queue lengths."""
    s = scheduler.stats
    kv = scheduler.kv_stats()
    stats = {
        "num_steps": s.num_steps,
        "num_preemptions": s.num_preemptions,
        "num_scheduled_tokens": s.num_scheduled_tokens,
        "max_batch_size": s.max_batch_size,
        "prefix_cache_queried_tokens": kv.prefix_queried_tokens,
        "prefix_cache_hit_tokens": kv.prefix_hit_tokens,
        "kv_blocks_total": kv.num_blocks,
        "kv_blocks_used": kv.num_used_blocks,
        "kv_blocks_free": kv.num_free_blocks,
        "kv_block_size": kv.block_size,
        "spec_proposed_tokens": s.spec_proposed_tokens,
        "spec_accepted_tokens": s.spec_accepted_tokens,
        "spec_verifications": s.spec_verifications,
        "spec_acceptance_rate": s.spec_acceptance_rate,
        "spec_mean_accepted_length": s.spec_mean_accepted_length,
        "num_running": scheduler.num_running,
        "num_waiting": scheduler.num_waiting,
    }
    stats.update(zip(STEP_BUCKET_KEYS, s.step_token_counts, strict=False))
    remote = scheduler.remote_kv
    if remote is not None:
        stats.update(remote.stats.as_dict(remote.num_loading, len(remote.held)))
    return stats
