"""What the model runner is told about one scheduled request (``ScheduledRequest``)."""

from __future__ import annotations

from platform_core.kv_cache.manager import KVCacheManager
from platform_core.scheduler.drafts import take_drafts
from platform_core.scheduler.output import ScheduledRequest
from platform_core.scheduler.request import Request

# ``ScheduledRequest(**fields)`` goes through ``type.__call__``, which packs the keywords into a
# dict and unpacks them again, doubling the cost of a record built for every request in every
# step; allocating and then calling the generated ``__init__`` keeps the keywords in the call.
_allocate = object.__new__
_init_scheduled_request = ScheduledRequest.__init__


def describe_request(request: Request, num_new: int, kv: KVCacheManager) -> ScheduledRequest:
    """The step's share of ``request``: its next ``num_new`` tokens (drafts included), the
    blocks the runner has not been sent, and whether the step ends in a sample (then the
    samples still to fork off, which share its logits)."""
    start = request.num_computed_tokens
    drafts, draft_probs = request.spec_token_ids, None
    if drafts or request.spec_draft_probs is not None:
        drafts, draft_probs = take_drafts(request)
    end = start + num_new - len(drafts)
    output_token_ids, prompt_token_ids = request.output_token_ids, request.prompt_token_ids
    sample = end == len(prompt_token_ids) + len(output_token_ids)
    token_ids = request.token_ids_slice(start, end)
    forks = request.pending_fork_ids
    first_block, new_block_ids = kv.unsent_block_ids(request.request_id)
    item = _allocate(ScheduledRequest)
    _init_scheduled_request(
        item,
        request_id=request.request_id,
        token_ids=token_ids + drafts if drafts else token_ids,
        start_position=start,
        block_ids=new_block_ids,
        sample=sample,
        sampling_params=request.sampling_params,
        output_token_ids=output_token_ids,
        prompt_token_ids=prompt_token_ids,
        fork_ids=list(forks) if sample and forks else [],
        num_draft_tokens=len(drafts),
        draft_probs=draft_probs,
        first_block=first_block,
        lora_request=request.lora_request,
    )
    return item
