"""Cumulative ``RequestOutput``s to step deltas (in the engine core) and back (in the front).

The engine builds a cumulative output per request and step; sending it whole would cost
quadratic bytes over a request's life. ``DeltaWriter`` remembers what it sent of each request
and writes only what is new; ``OutputAssembler`` keeps the cumulative state on the other side and
rebuilds outputs equal to the engine's, so code reading ``RequestOutput``s cannot tell the
engine ran elsewhere. Each rebuilt output has its own lists (as the engine's do): a reader may
keep an older output while newer ones arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from platform_core.engine.core_messages import CompletionDelta, RequestDelta
from platform_core.engine.outputs import (
    CompletionOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from platform_core.engine.request_stream import GenerateRequest


@dataclass(slots=True)
class _SentSample:
    tokens: int = 0
    text: str = ""
    logprobs: int = 0


@dataclass(slots=True)
class _SentRequest:
    prompt_ids_due: bool  # the client sent text: the token ids go out with the first delta
    prompt_logprobs_due: bool = True
    metrics: tuple | None = None  # what the metrics were when last sent
    samples: dict[int, _SentSample] = field(default_factory=dict)


class DeltaWriter:
    """The engine-core side: what each request's receiver already has."""

    def __init__(self) -> None:
        self._sent: dict[str, _SentRequest] = {}

    def expect(self, request: GenerateRequest) -> None:
        """Track ``request`` (accepted); its prompt ids go out once if the client sent text."""
        self._sent[request.request_id] = _SentRequest(request.prompt_token_ids is None)

    def delta(self, output: RequestOutput) -> RequestDelta:
        """What ``output`` adds to what was sent; a finished request is forgotten.

        This runs for every running request in every step, in the engine core: one pass, no
        helper calls (they showed in the per-step cost, ``benchmarks/engine_transport.py``).
        """
        sent = self._sent.get(output.request_id)
        if sent is None:
            sent = self._sent[output.request_id] = _SentRequest(False)
        samples = sent.samples
        completions = []
        for completion in output.outputs:
            sample = samples.get(completion.index)
            if sample is None:
                sample = samples[completion.index] = _SentSample()
            text, tokens, logprobs = completion.text, completion.token_ids, completion.logprobs
            # The text only grows while a request runs (text that may become a stop string is
            # held back, not taken back); should it ever change otherwise, it is sent whole.
            start = len(sample.text) if text.startswith(sample.text) else 0
            completions.append(
                CompletionDelta(
                    completion.index,
                    tokens[sample.tokens :],
                    start,
                    text[start:],
                    None if logprobs is None else logprobs[sample.logprobs :],
                    completion.cumulative_logprob,
                    completion.finish_reason,
                    completion.stop_reason,
                )
            )
            sample.tokens, sample.text = len(tokens), text
            if logprobs is not None:
                sample.logprobs = len(logprobs)
        metrics = output.metrics
        if metrics is not None:
            key = (
                metrics.scheduled_time,
                metrics.first_token_time,
                metrics.finished_time,
                metrics.num_cached_tokens,
                metrics.num_preemptions,
            )
            if key == sent.metrics:
                metrics = None  # unchanged, as in most steps
            else:
                sent.metrics = key
        prompt_ids = None
        if sent.prompt_ids_due:
            prompt_ids, sent.prompt_ids_due = output.prompt_token_ids, False
        prompt_logprobs = None
        if sent.prompt_logprobs_due and output.prompt_logprobs is not None:
            prompt_logprobs, sent.prompt_logprobs_due = output.prompt_logprobs, False
        if output.finished:
            del self._sent[output.request_id]
        return RequestDelta(
            output.request_id,
            completions,
            output.finished,
            metrics,
            output.num_cached_tokens,
            output.error,
            prompt_ids,
            prompt_logprobs,
        )

    def forget(self, request_ids: list[str]) -> None:
        """Stop tracking requests that will send nothing more (aborted)."""
        for request_id in request_ids:
            self._sent.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._sent)


@dataclass(slots=True)
class _Received:
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
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

    def apply(self, delta: RequestDelta) -> RequestOutput | None:
        """The request's output after ``delta`` (``None`` for a request not tracked)."""
        state = self._received.get(delta.request_id)
        if state is None:
            return None
        if delta.prompt_token_ids is not None:
            state.prompt_token_ids = delta.prompt_token_ids
        if delta.prompt_logprobs is not None:
            state.prompt_logprobs = delta.prompt_logprobs
        if delta.metrics is not None:
            state.metrics = delta.metrics
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
