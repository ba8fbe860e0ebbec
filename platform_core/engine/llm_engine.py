"""The synchronous engine: ``add_request`` then ``step()`` until no request is left.

``step()`` runs one iteration of schedule -> execute -> postprocess and returns a
``RequestOutput`` for every request that produced tokens or finished in it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from platform_core.config import EngineConfig
from platform_core.engine.detokenizer import IncrementalDetokenizer
from platform_core.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from platform_core.engine.setup import EngineSetup, build_engine_parts
from platform_core.errors import InvalidRequestError
from platform_core.sampling_params import SamplingParams
from platform_core.scheduler.output import ModelRunnerOutput
from platform_core.scheduler.request import Request, RequestStatus

logger = logging.getLogger("platform_core.engine")


@dataclass(slots=True)
class _Tracked:
    """Engine-side state of a request beside the scheduler's ``Request``."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    num_returned_tokens: int = 0


class LLMEngine:
    """Owns the backend, model runner, scheduler and tokenizer of one model."""

    def __init__(self, config: EngineConfig) -> None:
        parts: EngineSetup = build_engine_parts(config)
        self.config = parts.config
        self.backend = parts.backend
        self.runner = parts.runner
        self.scheduler = parts.scheduler
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.eos_token_ids = parts.eos_token_ids
        self.vocab_size = parts.vocab_size
        self.model_dir = parts.model_dir
        self.default_sampling = parts.default_sampling
        self._tracked: dict[str, _Tracked] = {}
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
    ) -> Request:
        """Validate and queue one request; raise ``InvalidRequestError`` if it cannot run."""
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("either a prompt or prompt_token_ids is required")
            prompt_token_ids = self.tokenize(prompt)
        self._validate(prompt_token_ids, params)
        if params.n != 1:
            raise InvalidRequestError("n > 1 is not supported yet", "n")
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        now = time.time() if arrival_time is None else arrival_time
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            arrival_time=now,
        )
        detokenizer = None
        if self.tokenizer is not None and params.detokenize:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            )
        self.scheduler.add_request(request)
        self._tracked[request_id] = _Tracked(request, prompt, detokenizer, RequestMetrics(now))
        return request

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens, but this model's context is "
                f"{self.max_model_len} tokens (at least one must be left to generate)",
                "prompt",
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}", "prompt"
            )
        params.validate_token_ids(self.vocab_size)

    def abort_request(self, request_ids: list[str]) -> None:
        """Stop requests now; their blocks are freed. Unknown ids are ignored."""
        for request in self.scheduler.abort(list(request_ids)):
            self._tracked.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute the model, then update and report requests."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            runner_output = ModelRunnerOutput(sampled={})
        else:
            runner_output = self.runner.execute(scheduler_output)
        self.scheduler.update(scheduler_output, runner_output)
        now = time.time()
        outputs = []
        for request_id in runner_output.sampled:
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                outputs.append(self._report(tracked, now))
        return outputs

    def _report(self, tracked: _Tracked, now: float) -> RequestOutput:
        request = tracked.request
        new_tokens = request.output_token_ids[tracked.num_returned_tokens :]
        tracked.num_returned_tokens = request.num_output_tokens
        if tracked.metrics.first_token_time is None:
            tracked.metrics.first_token_time = now
        if tracked.detokenizer is not None:
            tracked.detokenizer.add(new_tokens)
        finished = request.status.finished
        if finished:
            tracked.metrics.finished_time = now
            tracked.metrics.num_cached_tokens = request.num_cached_tokens
            tracked.metrics.num_preemptions = request.num_preemptions
            del self._tracked[request.request_id]
        completion = CompletionOutput(
            index=0,
            text=tracked.detokenizer.text if tracked.detokenizer else "",
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=tracked.metrics,
        )

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """Engine counters: preemptions, prefix-cache tokens, KV blocks, steps."""
        kv = self.scheduler.kv
        s = self.scheduler.stats
        return {
            "num_steps": s.num_steps,
            "num_preemptions": s.num_preemptions,
            "num_scheduled_tokens": s.num_scheduled_tokens,
            "max_batch_size": s.max_batch_size,
            "prefix_cache_queried_tokens": kv.stats.queried_tokens,
            "prefix_cache_hit_tokens": kv.stats.hit_tokens,
            "kv_blocks_total": kv.pool.num_blocks,
            "kv_blocks_used": kv.pool.num_used_blocks,
            "kv_blocks_free": kv.pool.num_free_blocks,
            "kv_block_size": kv.block_size,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }


__all__ = ["LLMEngine", "RequestStatus"]
