"""Continuous batching under a per-step token budget, decode first, with preemption.

Each step:
1. Running requests, oldest first, get their uncomputed tokens (one for a decode, a chunk for a
   prefill in progress). When the pool cannot hold them, the most recently admitted running
   request is preempted (blocks freed, recomputed later) until the allocation fits.
2. The rest of the budget admits waiting requests in arrival order (preempted ones first), each
   claiming its cached prefix and a chunk of its prompt. Waiting requests never preempt.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from platform_core.config import CacheConfig, SchedulerConfig
from platform_core.kv_cache.manager import KVCacheManager
from platform_core.scheduler.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from platform_core.scheduler.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0
    max_batch_size: int = 0


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

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        """Queue a new request (its id must be unused)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
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

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within ``max_num_batched_tokens`` and ``max_num_seqs``."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
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

        output = SchedulerOutput(
            scheduled=[self._describe(r, n) for r, n in scheduled],
            preempted_ids=[r.request_id for r in preempted],
            finished_ids=self._finished_ids,
        )
        self._finished_ids = []
        self.stats.num_steps += 1
        self.stats.num_scheduled_tokens += output.total_num_tokens
        self.stats.max_batch_size = max(self.stats.max_batch_size, len(scheduled))
        return output

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self.kv.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            remaining = request.num_tokens - num_cached_tokens
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if not self.kv.allocate_slots(request, num_new, cached):
                break
            self.waiting.popleft()
            self.kv.stats.queried_tokens += request.num_tokens
            self.kv.stats.hit_tokens += num_cached_tokens
            request.num_computed_tokens = num_cached_tokens
            request.num_cached_tokens = max(request.num_cached_tokens, num_cached_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        return budget

    def _describe(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.token_ids_slice(start, start + num_new),
            start_position=start,
            block_ids=self.kv.block_ids(request.request_id),
            sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            output_token_ids=request.output_token_ids,
            prompt_token_ids=request.prompt_token_ids,
        )

    def update(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance the scheduled requests by the executed step; return those that finished."""
        finished: list[Request] = []
        for item in output.scheduled:
            request = self.requests.get(item.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += item.num_tokens
            self.kv.cache_computed_blocks(request)
            token = runner_output.sampled.get(item.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            status = request.check_stop()
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if not r.status.finished]
        return finished

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.kv.forget(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
