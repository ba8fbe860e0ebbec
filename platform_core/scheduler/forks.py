"""Forking the extra samples of an ``n > 1`` request once its first token is sampled.

Each child starts where the parent is: the same prompt and computed tokens, sharing the parent's
full KV blocks and getting a copy of its partial one.
"""

from __future__ import annotations

from platform_core.kv_cache.manager import KVCacheManager
from platform_core.scheduler.request import Request, RequestStatus


def fork_samples(
    parent: Request, fork_ids: list[str], kv: KVCacheManager
) -> tuple[list[Request], list[tuple[int, int]]]:
    """The children of ``parent`` named ``fork_ids`` and the ``(src, dst)`` block copies they need.

    A child is RUNNING with the parent's computed KV, or, when no block is free for its copy,
    PREEMPTED with nothing computed (it is recomputed later).
    """
    parent.pending_fork_ids = []
    children: list[Request] = []
    copies: list[tuple[int, int]] = []
    for index, child_id in enumerate(fork_ids, start=1):
        child = Request(
            request_id=child_id,
            prompt_token_ids=parent.prompt_token_ids,
            sampling_params=parent.sampling_params.clone_for_sample(index),
            eos_token_ids=parent.eos_token_ids,
            max_tokens=parent.max_tokens,
            arrival_time=parent.arrival_time,
            cache_salt=parent.cache_salt,
            lora_request=parent.lora_request,
            num_computed_tokens=parent.num_computed_tokens,
            num_cached_tokens=parent.num_cached_tokens,
            status=RequestStatus.RUNNING,
        )
        child_copies = kv.fork(parent, child_id)
        if child_copies is None:
            child.num_computed_tokens = 0
            child.status = RequestStatus.PREEMPTED
        else:
            copies += child_copies
        children.append(child)
    return children, copies
