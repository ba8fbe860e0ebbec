"""Continuous batching under a per-step token budget, decode first, with preemption.

Each step:
1. Running requests, oldest first, get their uncomputed tokens (one for a decode, a chunk for a
   prefill in progress). When the pool cannot hold them, the most recently admitted running
   request is preempted (blocks freed, recomputed later) until the allocation fits.
2. The rest of the budget admits waiting requests in arrival order (preempted ones first), each
   claiming its cached prefix and a chunk of its prompt. Waiting requests never preempt. A
   request whose prompt is mostly blocks that this step is computing for another request waits
   one step: it then finds them cached instead of computing them again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from platform_core.config import CacheConfig, SchedulerConfig
from platform_core.errors import QueueFullError
from platform_core.kv_cache.manager import KVCacheManager, KVCacheStats
from platform_core.scheduler.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from platform_core.scheduler.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    max_batch_size: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0


class Scheduler:
    """Decides which tokens of which requests run in each step; owns request lifetimes."""

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int
    ):
        self.config = scheduler_config
        self.kv = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_ids: list[str] = []
        self._block_copies: list[tuple[int, int]] = []
        # Fork children created by the last update (some may have finished in it already).
        self.new_forks: dict[str, Request] = {}

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_seats_taken(self) -> int:
        return sum(r.num_seats for r in self.running)

    def find_request(self, request_id: str) -> Request | None:
        """The unfinished request ``request_id``, or a fork child created by the last update
        (which may have finished in it already)."""
        return self.requests.get(request_id) or self.new_forks.get(request_id)

    def kv_stats(self) -> KVCacheStats:
        """The KV cache's block occupancy and prefix-cache counters."""
        return self.kv.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while requests hold blocks."""
        return self.kv.reset_prefix_cache()

    def check_kv_integrity(self) -> None:
        """Raise ``BlockPoolError`` if the KV cache's bookkeeping is inconsistent."""
        self.kv.check_integrity()

    def add_request(self, request: Request) -> None:
        """Queue a new request (its id must be unused)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting (limit {limit})")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """Finish the given requests now and free their blocks; unknown ids are ignored."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            aborted.append(request)
        return aborted

    def finish(self, request_id: str, status: RequestStatus, reason: int | str | None) -> None:
        """Finish a request for a reason found outside the scheduler (a stop string)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        request.stop_reason = reason
        self.abort([request_id], status)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within ``max_num_batched_tokens`` and ``max_num_seqs``."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            uncomputed = request.num_tokens - request.num_computed_tokens
            drafts = request.spec_token_ids
            if drafts:
                drafts = drafts[: budget - 1] if uncomputed == 1 and budget > 1 else []
                request.spec_token_ids = drafts
            num_new = min(uncomputed + len(drafts), budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing after it can run either

        if not preempted:
            budget = self._admit_waiting(budget, scheduled)

        describe = self._describe
        output = SchedulerOutput(
            scheduled=[describe(r, n) for r, n in scheduled],
            preempted_ids=[r.request_id for r in preempted],
            finished_ids=self._finished_ids,
            block_copies=self._block_copies,
        )
        self._finished_ids = []
        self._block_copies = []
        self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += self.config.max_num_batched_tokens - budget
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(scheduled))
        return output

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        if not self.waiting:
            return budget
        seats = self.num_seats_taken
        # Blocks this step completes (prompt chunks: decodes rarely complete a shared block).
        in_flight: set[bytes] = set()
        for request, num_new in scheduled:
            if num_new > 1:
                in_flight.update(self.kv.blocks_completed_by(request, num_new))
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if seats + request.num_seats > self.config.max_num_seqs:
                break
            # Prompt logprobs need logits at every prompt position: such prompts are computed.
            wants_prompt_logprobs = request.sampling_params.prompt_logprobs is not None
            cached = [] if wants_prompt_logprobs else self.kv.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            remaining = request.num_tokens - num_cached_tokens
            if in_flight and not wants_prompt_logprobs:
                shared = self.kv.num_blocks_in_flight(request, len(cached), in_flight)
                if 2 * shared * self.kv.block_size >= remaining:
                    break  # at least half of what is left is being computed: next step hits
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if not self.kv.allocate_slots(request, num_new, cached):
                break
            self.waiting.popleft()
            self.kv.record_prefix_lookup(request.num_tokens, num_cached_tokens)
            request.num_computed_tokens = num_cached_tokens
            request.num_cached_tokens = max(request.num_cached_tokens, num_cached_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            if num_new > 1:
                in_flight.update(self.kv.blocks_completed_by(request, num_new))
            budget -= num_new
            seats += request.num_seats
        return budget

    def _describe(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        drafts, draft_probs = request.spec_token_ids, request.spec_draft_probs
        if drafts or draft_probs is not None:
            request.spec_token_ids, request.spec_draft_probs = [], None
            draft_probs = None if draft_probs is None else draft_probs[: len(drafts)]
        end = start + num_new - len(drafts)
        output_token_ids, prompt_token_ids = request.output_token_ids, request.prompt_token_ids
        sample = end == len(prompt_token_ids) + len(output_token_ids)
        token_ids = request.token_ids_slice(start, end)
        forks = request.pending_fork_ids
        first_block, new_block_ids = self.kv.unsent_block_ids(request.request_id)
        # Positional arguments (in field order): this runs for every request in every step.
        return ScheduledRequest(
            request.request_id,
            token_ids + drafts if drafts else token_ids,
            start,
            new_block_ids,
            sample,
            request.sampling_params,
            output_token_ids,
            prompt_token_ids,
            list(forks) if sample and forks else [],
            len(drafts),
            draft_probs,
            first_block,
        )

    def update(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance the scheduled requests by the executed step; return those that finished."""
        finished: list[Request] = []
        self.new_forks = {}
        requests, sampled, running = self.requests, runner_output.sampled, RequestStatus.RUNNING
        cache_computed_blocks, append_tokens = self.kv.cache_computed_blocks, self._append_tokens
        for item in output.scheduled:
            request = requests.get(item.request_id)
            if request is None or request.status is not running:
                continue  # aborted while the step ran
            tokens = sampled.get(item.request_id)
            num_drafts = item.num_draft_tokens
            # KV of rejected drafts is garbage: it is neither counted as computed nor cached.
            rejected = num_drafts - (len(tokens) - 1) if tokens and num_drafts else 0
            request.num_computed_tokens += len(item.token_ids) - rejected
            if num_drafts:
                self._record_verification(request, num_drafts, rejected)
            if not tokens:
                cache_computed_blocks(request)
                continue
            status = append_tokens(request, tokens)
            ended = [] if status is None else [(request, status)]
            for child in self._fork(request, item.fork_ids) if item.fork_ids else ():
                child_status = append_tokens(child, sampled[child.request_id])
                if child_status is not None:
                    ended.append((child, child_status))
            # Accepted drafts are known tokens only now: publish blocks after appending.
            cache_computed_blocks(request)
            for sample, sample_status in ended:
                self._finish(sample, sample_status)
                finished.append(sample)
        if finished:
            self.running = [r for r in self.running if not r.status.finished]
            self.waiting = deque(r for r in self.waiting if not r.status.finished)
        return finished

    @staticmethod
    def _append_tokens(request: Request, tokens: list[int]) -> RequestStatus | None:
        """Append sampled tokens one by one; stop at the first that ends the request."""
        for token in tokens:
            request.output_token_ids.append(token)
            status = request.check_stop()
            if status is not None:
                return status
        return None

    def _record_verification(self, request: Request, num_drafts: int, rejected: int) -> None:
        self.stats.spec_verifications += 1
        self.stats.spec_proposed_tokens += num_drafts
        self.stats.spec_accepted_tokens += num_drafts - rejected
        if rejected:
            self.kv.trim(request)

    def _fork(self, parent: Request, fork_ids: list[str]) -> list[Request]:
        """Create the extra samples of ``parent`` sharing its computed prompt blocks."""
        parent.pending_fork_ids = []
        children = []
        for index, child_id in enumerate(fork_ids, start=1):
            child = Request(
                request_id=child_id,
                prompt_token_ids=parent.prompt_token_ids,
                sampling_params=parent.sampling_params.clone_for_sample(index),
                eos_token_ids=parent.eos_token_ids,
                max_tokens=parent.max_tokens,
                arrival_time=parent.arrival_time,
                cache_salt=parent.cache_salt,
                num_computed_tokens=parent.num_computed_tokens,
                num_cached_tokens=parent.num_cached_tokens,
                status=RequestStatus.RUNNING,
            )
            self.requests[child_id] = child
            self.new_forks[child_id] = child
            copies = self.kv.fork(parent, child_id)
            if copies is None:  # no block for the copy: recompute this sample later
                child.num_computed_tokens = 0
                child.status = RequestStatus.PREEMPTED
                self.waiting.appendleft(child)
            else:
                self._block_copies += copies
                self.running.append(child)
            children.append(child)
        return children

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.spec_token_ids, request.spec_draft_probs = [], None
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request.request_id)
        self.kv.forget(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
