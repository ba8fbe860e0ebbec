"""The synchronous engine: ``add_request`` then ``step()`` until no request is left.

``step()`` runs one iteration of schedule -> execute -> postprocess and returns a
``RequestOutput`` for every request that produced tokens or finished in it (for a request added
with ``stream=False``, only when it finishes).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from typing import Any

from platform_core.config import EngineConfig
from platform_core.engine.detokenizer import IncrementalDetokenizer
from platform_core.engine.faults import FaultInjector
from platform_core.engine.isolation import execute_isolated
from platform_core.engine.outputs import RequestMetrics, RequestOutput
from platform_core.engine.sequence_state import RequestState, SampleState
from platform_core.engine.setup import build_engine_parts
from platform_core.engine.stats import engine_stats
from platform_core.engine.validation import (
    RequestLimits,
    check_kv_transfer_params,
    validate_request,
)
from platform_core.errors import InvalidRequestError
from platform_core.executor.base import WorkerDiedError
from platform_core.lora.admission import LoRAAdmission
from platform_core.lora_request import LoRARequest
from platform_core.reasoning import get_reasoning_parser
from platform_core.sampling_params import SamplingParams
from platform_core.scheduler.output import ModelRunnerOutput
from platform_core.scheduler.request import Request, RequestStatus
from platform_core.structured_output.manager import StructuredOutputManager
from platform_core.worker.kv_tensors import KVCacheInfo

logger = logging.getLogger("platform_core.engine")

DEADLINE_EXCEEDED = "deadline exceeded"  # the error of a request aborted at its deadline
# How long an otherwise idle step waits for a grammar to compile (the loop then checks commands).
GRAMMAR_WAIT_S = 0.05
# How long a step with nothing to compute but KV transfers to watch waits before polling them.
KV_TRANSFER_POLL_S = 0.002


class LLMEngine:
    """Owns the backend, model runner, scheduler and tokenizer of one model."""

    def __init__(self, config: EngineConfig) -> None:
        # Looked up first: an unknown name fails before any worker starts.
        reasoning_name = config.structured_outputs.reasoning_parser
        reasoning_class = None if reasoning_name is None else get_reasoning_parser(reasoning_name)
        parts = build_engine_parts(config)
        self.config = parts.config
        self.backend = parts.backend
        self.executor = parts.executor
        self.runner = parts.runner
        self.scheduler = parts.scheduler
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.eos_token_ids = parts.eos_token_ids
        self.vocab_size = parts.vocab_size
        self.model_dir = parts.model_dir
        self.hf_config = parts.hf_config
        self.default_sampling = parts.default_sampling
        self.proposer = parts.proposer
        self._no_drafts_at = self.config.speculative.speculative_disable_by_batch_size
        self.limits = RequestLimits(
            self.max_model_len,
            self.vocab_size,
            self.config.scheduler.max_num_seqs,
            self.tokenizer is not None,
        )
        self.structured = StructuredOutputManager(
            self.config.structured_outputs.structured_outputs_backend,
            self.tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            # constraints apply once the reasoning ended
            None if reasoning_class is None else reasoning_class(self.tokenizer),
        )
        self.lora_admission = LoRAAdmission(self.config.lora, self.hf_config)
        self.faults: FaultInjector | None = None  # tests set one to inject failures
        # A heap of (deadline, tie-break, request); entries of finished requests stay until
        # their deadline comes up (or a compaction), so adding and finishing are O(log n).
        self._deadlines: list[tuple[float, int, RequestState]] = []
        self._deadline_seq = itertools.count()
        self._requests: dict[str, RequestState] = {}
        # sample id (a request id, or a fork's id) -> (its request, its sample index)
        self._samples: dict[str, tuple[RequestState, int]] = {}
        self._next_id = 0

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer; pass prompt_token_ids instead of text", "prompt"
            )
        return self.tokenizer.encode(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        deadline: float | None = None,
        stream: bool = True,
        lora_request: LoRARequest | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        """Validate and queue one request (run with the adapter ``lora_request``, if given).

        Raises ``InvalidRequestError`` if it cannot run and ``QueueFullError`` when the waiting
        queue is full. ``deadline`` (a ``time.monotonic()`` value) aborts the request with an
        error once passed, wherever it is. With ``stream=False`` ``step()`` reports the request
        only when it finishes (building an output every step costs time at large batches).
        ``kv_transfer_params`` instruct the KV connector (``kv_transfer_config``): e.g.
        ``{"do_remote_decode": True}`` on a prefill instance, or the parameters a prefill
        instance returned, on a decode instance.
        """
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("either a prompt or prompt_token_ids is required")
            prompt_token_ids = self.tokenize(prompt)
        prompt_token_ids = list(prompt_token_ids)
        validate_request(prompt_token_ids, params, self.limits)
        self.lora_admission.check(lora_request)
        if params.structured_outputs is not None:
            self.structured.check(params.structured_outputs)
        self.scheduler.check_room(self.structured.num_parked)
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        now = time.time() if arrival_time is None else arrival_time
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            arrival_time=now,
            cache_salt=cache_salt,
            lora_request=lora_request,
            kv_transfer_params=check_kv_transfer_params(
                kv_transfer_params, self.scheduler.remote_kv is not None
            ),
            pending_fork_ids=[f"{request_id}#{i}" for i in range(1, params.n)],
        )
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, RequestMetrics(now), stream=stream
        )
        state.samples.append(self._sample_state(request, 0))
        if params.structured_outputs is None or self.structured.submit(request):
            self.scheduler.add_request(request, check_room=False)
        self._requests[request_id] = state
        self._samples[request_id] = (state, 0)
        for index, fork_id in enumerate(request.pending_fork_ids, start=1):
            self._samples[fork_id] = (state, index)
        if deadline is not None:
            self._add_deadline(deadline, state)

    def _sample_state(self, request: Request, index: int) -> SampleState:
        params = request.sampling_params
        detokenizer = None
        if self.tokenizer is not None and params.detokenize:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            )
        return SampleState(request, index, detokenizer)

    def abort_request(self, request_ids: list[str]) -> None:
        """Stop requests (and all their samples) now; blocks are freed. Unknown ids are ignored.

        O(k + n) for k ids among n unfinished requests, however many are aborted at once.
        """
        found = {}
        for request_id in request_ids:
            state = self._requests.get(request_id)
            if state is not None:
                found[request_id] = state
        self._finish_states(list(found.values()), RequestStatus.FINISHED_ABORTED)

    def _finish_states(self, states: list[RequestState], status: RequestStatus) -> None:
        """Finish every sample of ``states`` with ``status`` in one scheduler call; forget them."""
        if not states:
            return
        self.scheduler.abort([sid for state in states for sid in state.sample_ids], status)
        for state in states:
            self._forget(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_pending_kv_transfers(self) -> bool:
        """Whether the KV connector has blocks held for peers or loads in flight: steps must go
        on (they may schedule nothing) until they are settled."""
        return self.scheduler.has_pending_transfers

    def check_health(self) -> None:
        """Raise ``WorkerDiedError`` if a model worker is gone (every request then fails)."""
        try:
            self.executor.check_health()
        except WorkerDiedError:
            self._fail_all("a model worker died")
            raise

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute the model, then update and report requests.

        A request whose step fails alone (bad input reaching the model, a failing processor) is
        finished with an error and its blocks freed; the others go on. ``WorkerDiedError`` means
        the engine is dead: every request fails and the error propagates.
        """
        outputs = self._expire_deadlines()
        if self.structured.num_parked:
            outputs += self._admit_compiled()
        scheduler_output = self.scheduler.schedule()
        self.structured.drop_matchers(scheduler_output.preempted_ids)
        self.structured.fill_bitmasks(scheduler_output.scheduled)
        runner_output, failed = ModelRunnerOutput(), {}
        if scheduler_output.is_empty and self.structured.num_parked:
            self.structured.wait(GRAMMAR_WAIT_S)  # nothing else to do: do not spin
        transfers_only = scheduler_output.is_empty and self.scheduler.has_pending_transfers
        if transfers_only:
            time.sleep(KV_TRANSFER_POLL_S)  # only transfers to watch: do not spin
        if not scheduler_output.is_empty or transfers_only:
            check = None if self.faults is None else self.faults.check
            try:
                runner_output, failed = execute_isolated(self.executor, scheduler_output, check)
            except WorkerDiedError:
                self._fail_all("a model worker died")
                raise
        for sample_id, error in failed.items():
            outputs += self._fail(sample_id, error)
        self.scheduler.update(scheduler_output, runner_output)
        outputs += self._advance_grammars(runner_output)
        outputs += self._postprocess(runner_output)
        if self.proposer is not None:
            self.scheduler.propose_drafts(self.proposer, self.max_model_len, self._no_drafts_at)
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the parked requests whose grammar compiled; fail those whose compile failed."""
        ready, failed = self.structured.take_ready()
        for request in ready:
            self.scheduler.add_request(request, check_room=False)
        outputs = []
        for request, error in failed:
            outputs += self._fail(request.request_id, error)
        return outputs

    def _advance_grammars(self, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """Feed the new tokens to the constrained samples' grammars: a token outside the grammar
        fails its request, a grammar that accepted its end finishes its sample."""
        errors, ended = self.structured.advance(runner_output.sampled, self.scheduler.find_request)
        for sample_id in ended:
            self.scheduler.finish(sample_id, RequestStatus.FINISHED_STOPPED, None)
        outputs = []
        for sample_id, error in errors.items():
            outputs += self._fail(sample_id, error)
        return outputs

    def _fail(
        self, sample_id: str, error: str, status: RequestStatus = RequestStatus.FINISHED_ERROR
    ) -> list[RequestOutput]:
        """Finish the request owning ``sample_id`` with ``error``; its final output."""
        found = self._samples.get(sample_id)
        if found is None:
            return []
        state = found[0]
        self._finish_states([state], status)
        logger.warning("request %s failed: %s", state.request_id, error)
        return [state.output(error=error)]

    def _add_deadline(self, deadline: float, state: RequestState) -> None:
        heap = self._deadlines
        if len(heap) > 2 * len(self._requests) + 64:  # mostly finished requests: compact
            heap[:] = [e for e in heap if self._requests.get(e[2].request_id) is e[2]]
            heapq.heapify(heap)
        heapq.heappush(heap, (deadline, next(self._deadline_seq), state))

    def _expire_deadlines(self) -> list[RequestOutput]:
        """Abort the requests whose deadline passed; O(expired + log n) per step."""
        heap = self._deadlines
        now = time.monotonic()
        expired: list[RequestState] = []
        while heap and heap[0][0] <= now:
            state = heapq.heappop(heap)[2]
            if self._requests.get(state.request_id) is state:  # not finished (or id reused)
                expired.append(state)
        if not expired:
            return []
        self._finish_states(expired, RequestStatus.FINISHED_ABORTED)
        logger.warning("%d request(s) passed their deadline: aborted", len(expired))
        return [state.output(error=DEADLINE_EXCEEDED) for state in expired]

    def _postprocess(self, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        now = time.time()
        touched: dict[str, RequestState] = {}
        for request_id, (first, entries) in runner_output.prompt_logprobs.items():
            state, _ = self._samples[request_id]
            state.record_prompt_logprobs(first, entries, self.tokenizer)
        outputs = []
        for sample_id in runner_output.sampled:
            found = self._samples.get(sample_id)
            if found is None:
                continue
            state, index = found
            try:
                if self.faults is not None:
                    self.faults.check("postprocess", [state.request_id])
                sample = self._sample_of(state, index, sample_id)
                stop = sample.absorb(runner_output.logprobs.get(sample_id, []), self.tokenizer)
            except Exception as exc:  # one request's detokenization must not stop the others
                touched.pop(state.request_id, None)
                outputs += self._fail(sample_id, f"{type(exc).__name__}: {exc}")
                continue
            if stop is not None:
                self.scheduler.finish(sample_id, RequestStatus.FINISHED_STOPPED, stop)
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            # A request that reports only when done needs a look only when a sample ended.
            if state.stream or sample.request.status.finished:
                touched[state.request_id] = state
        for state in touched.values():
            if not state.stream and not state.finished:
                continue
            output = state.output()
            if output.finished:
                state.metrics.finished_time = now
                self._forget(state)
            outputs.append(output)
        return outputs

    def _sample_of(self, state: RequestState, index: int, sample_id: str) -> SampleState:
        for sample in state.samples:
            if sample.index == index:
                return sample
        sample = self._sample_state(self.scheduler.find_request(sample_id), index)
        state.samples.append(sample)
        state.samples.sort(key=lambda s: s.index)
        return sample

    def _fail_all(self, reason: str) -> None:
        """Finish every request with an error (the engine cannot continue)."""
        self._finish_states(list(self._requests.values()), RequestStatus.FINISHED_ERROR)
        logger.error("all requests failed: %s", reason)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (e.g. between benchmark runs); only when idle."""
        return self.scheduler.reset_prefix_cache()

    def check_kv_integrity(self) -> None:
        """Raise ``BlockPoolError`` if the KV blocks' bookkeeping is inconsistent (a bug)."""
        self.scheduler.check_kv_integrity()

    def kv_cache_info(self) -> KVCacheInfo:
        """The KV cache of the driver rank (rank 0, in this process) as allocated.

        Under tensor parallelism every rank holds its own shard of this size; a draft model's
        cache (same block ids) is not included.
        """
        return self.runner.kv_cache_info()

    def shutdown(self) -> None:
        """Stop worker processes (if any); the engine is unusable afterwards."""
        self.structured.shutdown()
        if self.scheduler.remote_kv is not None:
            self.scheduler.remote_kv.connector.shutdown()
        self.runner.shutdown()
        self.executor.shutdown()

    def _forget(self, state: RequestState) -> None:
        self._requests.pop(state.request_id, None)
        for sample_id in state.sample_ids:
            self._samples.pop(sample_id, None)
        self.structured.forget(state.sample_ids)

    def stats(self) -> dict[str, Any]:
        """Engine counters: preemptions, prefix-cache tokens, KV blocks, steps."""
        return engine_stats(self.scheduler)
