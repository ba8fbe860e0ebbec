"""Continuous batching under a per-step token budget, decode first, with preemption.

Each step:
1. Running requests, oldest first, get their uncomputed tokens (one for a decode, a chunk for a
   prefill in progress). When the pool cannot hold them, the most recently admitted running
   request is preempted (blocks freed, recomputed later) until the allocation fits.
2. The rest of the budget admits waiting requests in arrival order (preempted ones first), each
   claiming its cached prefix and a chunk of its prompt. Waiting requests never preempt. A
   request whose prompt is mostly blocks that this step is computing for another request waits
   one step: it then finds them cached instead of computing them again. With LoRA at most
   ``max_loras`` adapters run at once: a request whose adapter would be one too many stays
   waiting while later requests (of running adapters or the base model) are admitted.

With a KV connector (``remote_kv``) a waiting request whose prompt a remote instance holds gets
blocks for it and waits, neither running nor holding up others, while the blocks load; and a
finished request whose blocks a peer will read keeps them until the peer has them.

Forking the samples of an ``n > 1`` request (``forks``), speculative drafts (``drafts``), the
message for each scheduled request (``describe``) and the counters (``stats``) have their own
modules.
"""

from __future__ import annotations

import time

from platform_core.config import CacheConfig, SchedulerConfig
from platform_core.errors import QueueFullError
from platform_core.kv_cache.manager import KVCacheManager, KVCacheStats
from platform_core.kv_transfer.interfaces import KVConnectorScheduler
from platform_core.scheduler.describe import describe_request
from platform_core.scheduler.drafts import DraftProposer, fit_drafts, propose_drafts, settle_drafts
from platform_core.scheduler.forks import fork_samples
from platform_core.scheduler.output import ModelRunnerOutput, SchedulerOutput
from platform_core.scheduler.queue import RequestQueue
from platform_core.scheduler.remote_kv import RemoteKV
from platform_core.scheduler.request import Request, RequestStatus
from platform_core.scheduler.stats import SchedulerStats


class Scheduler:
    """Decides which tokens of which requests run in each step; owns request lifetimes."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_loras: int | None = None,
        kv_connector: KVConnectorScheduler | None = None,
        kv_hold_timeout_s: float = 120.0,
    ):
        self.config = scheduler_config
        self.max_loras = max_loras
        self.kv = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        #: the KV connector's side of scheduling (None: no connector)
        self.remote_kv = (
            None if kv_connector is None else RemoteKV(kv_connector, self.kv, kv_hold_timeout_s)
        )
        self.waiting = RequestQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_ids: list[str] = []
        self._block_copies: list[tuple[int, int]] = []
        # Fork children created by the last update (some may have finished in it already).
        self._new_forks: dict[str, Request] = {}

    @property
    def num_unfinished(self) -> int:
        loading = 0 if self.remote_kv is None else self.remote_kv.num_loading
        return len(self.waiting) + len(self.running) + loading

    @property
    def has_pending_transfers(self) -> bool:
        """Blocks held for a peer or being loaded: the connector needs steps to finish them."""
        return self.remote_kv is not None and self.remote_kv.pending

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def find_request(self, request_id: str) -> Request | None:
        """The unfinished request ``request_id``, or a fork child created by the last update
        (which may have finished in it already)."""
        return self.requests.get(request_id) or self._new_forks.get(request_id)

    def kv_stats(self) -> KVCacheStats:
        """The KV cache's block occupancy and prefix-cache counters."""
        return self.kv.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while requests hold blocks."""
        return self.kv.reset_prefix_cache()

    def check_kv_integrity(self) -> None:
        """Raise ``BlockPoolError`` if the KV cache's bookkeeping is inconsistent."""
        self.kv.check_integrity()

    def check_room(self, num_waiting_elsewhere: int = 0) -> None:
        """Raise ``QueueFullError`` when the waiting requests, with ``num_waiting_elsewhere``
        held outside the scheduler (for a grammar to compile), are at ``max_waiting_requests``."""
        limit = self.config.max_waiting_requests
        num_waiting = len(self.waiting) + num_waiting_elsewhere
        if limit is not None and num_waiting >= limit:
            raise QueueFullError(f"{num_waiting} requests are waiting (limit {limit})")

    def add_request(self, request: Request, check_room: bool = True) -> None:
        """Queue a new request (its id must be unused); ``check_room=False`` when the caller
        did (``check_room``) before holding it elsewhere."""
        if request.request_id in self.requests or (
            self.remote_kv is not None and self.remote_kv.holds_blocks_of(request.request_id)
        ):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if check_room:
            self.check_room()
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(
        self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """Finish the given requests now and free their blocks; unknown ids are ignored.

        O(k) for k ids plus one pass over the running list (at most ``max_num_seqs``) when a
        running request is among them; the others keep their order.
        """
        aborted = []
        any_running = False
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue
            if request.status is RequestStatus.RUNNING:
                any_running = True
            elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.remote_kv.abandon(request)  # its blocks are freed once the load ends
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            aborted.append(request)
        if any_running:
            self.running = [r for r in self.running if not r.status.finished]
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
        if self.remote_kv is not None:
            self.remote_kv.expire_holds()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = request.num_tokens - request.num_computed_tokens
            if request.spec_token_ids:
                num_new += fit_drafts(request, num_new, budget)
            num_new = min(num_new, budget)
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

        kv = self.kv
        output = SchedulerOutput(
            scheduled=[describe_request(r, n, kv) for r, n in scheduled],
            preempted_ids=[r.request_id for r in preempted],
            finished_ids=self._finished_ids,
            block_copies=self._block_copies,
            kv_connector_metadata=None if self.remote_kv is None else self.remote_kv.metadata(),
        )
        self._finished_ids = []
        self._block_copies = []
        self.stats.record_step(self.config.max_num_batched_tokens - budget, len(scheduled))
        return output

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        if not self.waiting:
            return budget
        adapters = _AdapterRoom(self.max_loras, self.running, self.config.max_num_seqs)
        try:
            return self._admit_in_order(budget, scheduled, adapters)
        finally:
            for request in reversed(adapters.passed_over):
                self.waiting.appendleft(request)

    def _admit_in_order(
        self, budget: int, scheduled: list[tuple[Request, int]], adapters: _AdapterRoom
    ) -> int:
        seats = sum(r.num_seats for r in self.running)
        # Blocks this step completes (prompt chunks: decodes rarely complete a shared block).
        in_flight: set[bytes] = set()
        for request, num_new in scheduled:
            if num_new > 1:
                in_flight.update(self.kv.blocks_completed_by(request, num_new))
        while self.waiting and budget > 0:
            request = self.waiting.first()
            if seats + request.num_seats > self.config.max_num_seqs:
                break
            if not adapters.fits(request):
                if not adapters.pass_over(self.waiting.popleft()):
                    break
                continue
            # Prompt logprobs need logits at every prompt position: such prompts are computed.
            wants_prompt_logprobs = request.sampling_params.prompt_logprobs is not None
            if self.kv.block_ids(request.request_id):  # its blocks were loaded from a peer
                cached, num_cached_tokens = [], request.num_computed_tokens
            else:
                cached = [] if wants_prompt_logprobs else self.kv.find_cached_prefix(request)
                num_cached_tokens = len(cached) * self.kv.block_size
                if self.remote_kv is not None and not request.kv_load_checked:
                    loading = self.remote_kv.start_load(request, cached)
                    if loading is None:
                        break  # no room for its blocks yet
                    if loading:
                        self.waiting.popleft()
                        continue
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
            adapters.admit(request)
            self.kv.record_prefix_lookup(request.num_tokens, num_cached_tokens)
            request.num_computed_tokens = num_cached_tokens
            request.num_cached_tokens = max(request.num_cached_tokens, num_cached_tokens)
            request.status = RequestStatus.RUNNING
            if not request.scheduled_time:
                request.scheduled_time = time.time()
            self.running.append(request)
            scheduled.append((request, num_new))
            if num_new > 1:
                in_flight.update(self.kv.blocks_completed_by(request, num_new))
            budget -= num_new
            seats += request.num_seats
        return budget

    def update(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance the scheduled requests by the executed step; return those that finished."""
        finished: list[Request] = []
        self._new_forks = {}
        if self.remote_kv is not None and runner_output.kv_connector is not None:
            for request in reversed(self.remote_kv.update(runner_output.kv_connector)):
                self.waiting.appendleft(request)  # loaded: first in line, in load order
        requests, sampled, running = self.requests, runner_output.sampled, RequestStatus.RUNNING
        cache_computed_blocks = self.kv.cache_computed_blocks
        for item in output.scheduled:
            request = requests.get(item.request_id)
            if request is None or request.status is not running:
                continue  # aborted while the step ran
            tokens = sampled.get(item.request_id)
            request.num_computed_tokens += len(item.token_ids)
            if item.num_draft_tokens:
                settle_drafts(request, item.num_draft_tokens, tokens, self.kv, self.stats)
            if not tokens:
                cache_computed_blocks(request)
                continue
            status = request.append_tokens(tokens)
            ended = [] if status is None else [(request, status)]
            for child in self._add_forks(request, item.fork_ids) if item.fork_ids else ():
                child_status = child.append_tokens(sampled[child.request_id])
                if child_status is not None:
                    ended.append((child, child_status))
            # Accepted drafts are known tokens only now: publish blocks after appending.
            cache_computed_blocks(request)
            for sample, sample_status in ended:
                if sample.status is not running:  # a fork child with no block to run yet
                    self.waiting.remove(sample)
                self._finish(sample, sample_status)
                finished.append(sample)
        if finished:
            self.running = [r for r in self.running if not r.status.finished]
        return finished

    def propose_drafts(
        self, proposer: DraftProposer, max_model_len: int, disable_at: int | None = None
    ) -> None:
        """Have ``proposer`` draft the next step's tokens of the decoding requests (see
        ``drafts.propose_drafts``); it may claim their blocks."""
        propose_drafts(proposer, self.running, self.kv, max_model_len, disable_at)

    def _add_forks(self, parent: Request, fork_ids: list[str]) -> list[Request]:
        """Fork the extra samples of ``parent`` and queue each where it can run."""
        children, copies = fork_samples(parent, fork_ids, self.kv)
        self._block_copies += copies
        for child in children:
            self.requests[child.request_id] = child
            self._new_forks[child.request_id] = child
            if child.status is RequestStatus.RUNNING:
                self.running.append(child)
            else:
                self.waiting.appendleft(child)
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
        normal = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        loading = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        request.status = status
        if self.remote_kv is None or not (loading or self.remote_kv.keep_blocks(request, normal)):
            self.kv.free(request.request_id)
        self.kv.forget(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)


class _AdapterRoom:
    """The LoRA adapters of one admission pass: at most ``max_loras`` (None: no limit) run at
    once. A waiting request of an adapter that would be one too many is passed over (up to
    ``max_passed_over`` of them; the caller puts them back at the head, in order) so that
    later requests of running adapters and of the base model are not held up behind it."""

    def __init__(self, max_loras: int | None, running: list[Request], max_passed_over: int):
        self.max_loras = max_loras
        # Without a limit nothing is counted: the pass over the running list costs every step.
        self.running: set[int] = (
            set()
            if max_loras is None
            else {r.lora_request.lora_int_id for r in running if r.lora_request}
        )
        self.passed_over: list[Request] = []
        self._max_passed_over = max_passed_over

    def fits(self, request: Request) -> bool:
        lora = request.lora_request
        if lora is None or self.max_loras is None or lora.lora_int_id in self.running:
            return True
        return len(self.running) < self.max_loras

    def admit(self, request: Request) -> None:
        if request.lora_request is not None:
            self.running.add(request.lora_request.lora_int_id)

    def pass_over(self, request: Request) -> bool:
        """Set ``request`` aside; False (nothing more can be passed over) when full."""
        self.passed_over.append(request)
        return len(self.passed_over) < self._max_passed_over
