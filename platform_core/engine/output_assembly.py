"""A step's deltas back to cumulative ``RequestOutput``s, in the front (``OutputAssembler``).

The assembler keeps each request's cumulative state and rebuilds outputs equal to the engine's
from what ``output_deltas.DeltaWriter`` sent, so code reading ``RequestOutput``s cannot tell
the engine ran elsewhere. Each rebuilt output has its own lists (as the engine's do): a reader
may keep an older output while newer ones arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from platform_core.engine.core_messages import CompletionDelta, RequestDelta, StepDeltas
from platform_core.engine.outputs import (
    CompletionOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from platform_core.engine.request_stream import GenerateRequest


@dataclass(slots=True)
class _Received:
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    samples: dict[int, CompletionOutput] = field(default_factory=dict)


class OutputAssembler:
    """The front side: each request's cumulative output, rebuilt from its deltas."""

    def __init__(self) -> None:
        self._received: dict[str, _Received] = {}

    def expect(self, request: GenerateRequest) -> None:
        """Track ``request`` (accepted by the engine)."""
        self._received[request.request_id] = _Received(
            request.prompt, list(request.prompt_token_ids or [])
        )

    def apply(self, step: StepDeltas) -> list[RequestOutput]:
        """The outputs after ``step``: its column requests' first, then its others' (requests
        not tracked, aborted meanwhile, are skipped)."""
        outputs = []
        received = self._received
        token_ids, end = step.token_ids, 0
        columns = zip(
            step.request_ids,
            step.token_counts,
            step.texts,
            step.logprobs,
            step.cumulative_logprobs,
            strict=True,
        )
        for request_id, count, text, logprobs, cumulative in columns:
            start, end = end, end + count
            state = received.get(request_id)
            if state is None:
                continue
            before = state.samples[0]
            if logprobs is not None and before.logprobs:
                logprobs = before.logprobs + logprobs
            completion = CompletionOutput(
                0,
                before.text + text,
                before.token_ids + token_ids[start:end],
                None,
                None,
                logprobs,
                cumulative,
            )
            state.samples[0] = completion
            outputs.append(
                RequestOutput(
                    request_id,
                    state.prompt,
                    state.prompt_token_ids,
                    [completion],
                    False,
                    state.metrics,
                    state.prompt_logprobs,
                    state.num_cached_tokens,
                    None,
                )
            )
        for delta in step.others:
            output = self._apply(delta)
            if output is not None:
                outputs.append(output)
        return outputs

    def _apply(self, delta: RequestDelta) -> RequestOutput | None:
        state = self._received.get(delta.request_id)
        if state is None:
            return None
        if delta.prompt_token_ids is not None:
            state.prompt_token_ids = delta.prompt_token_ids
        if delta.prompt_logprobs is not None:
            state.prompt_logprobs = delta.prompt_logprobs
        if delta.metrics is not None:
            state.metrics = delta.metrics
        state.num_cached_tokens = delta.num_cached_tokens
        completions = []
        for part in delta.completions:
            completion = _extend(state.samples.get(part.index), part)
            state.samples[part.index] = completion
            completions.append(completion)
        if delta.finished:
            del self._received[delta.request_id]
        return RequestOutput(
            delta.request_id,
            state.prompt,
            state.prompt_token_ids,
            completions,
            delta.finished,
            state.metrics,
            state.prompt_logprobs,
            delta.num_cached_tokens,
            delta.error,
            delta.kv_transfer_params,
        )

    def forget(self, request_ids: list[str]) -> None:
        """Stop tracking requests (aborted: nothing more comes for them)."""
        for request_id in request_ids:
            self._received.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._received)


def _extend(before: CompletionOutput | None, part: CompletionDelta) -> CompletionOutput:
    if before is None:
        token_ids, text, logprobs = part.token_ids, part.text, part.logprobs
    else:
        token_ids = before.token_ids + part.token_ids
        text = before.text[: part.text_start] + part.text
        logprobs = part.logprobs
        if logprobs is not None and before.logprobs:
            logprobs = before.logprobs + logprobs
    return CompletionOutput(
        part.index,
        text,
        token_ids,
        part.finish_reason,
        part.stop_reason,
        logprobs,
        part.cumulative_logprob,
    )
