"""Engine-side state of each sample (detokenization, stop strings, logprobs) and of each request.

The scheduler knows token ids; this module turns them into what callers see: text that grows
incrementally, cut at stop strings, with logprobs in the OpenAI/vLLM shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from platform_core.engine.detokenizer import IncrementalDetokenizer
from platform_core.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from platform_core.sample.logprobs import TokenLogprobs
from platform_core.sampling_params import SamplingParams
from platform_core.scheduler.request import Request


def to_position_logprobs(entry: TokenLogprobs, tokenizer: Any) -> PositionLogprobs:
    """The chosen token's logprob first, then the top alternatives (with their texts)."""

    def text(token_id: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([token_id])

    position = {entry.token_id: Logprob(entry.logprob, entry.rank, text(entry.token_id))}
    for rank, (token_id, logprob) in enumerate(entry.top, start=1):
        if token_id not in position:
            position[token_id] = Logprob(logprob, rank, text(token_id))
    return position


@dataclass(slots=True)
class SampleState:
    """One generated sequence: its tokens so far as text, logprobs, and stop-string outcome."""

    request: Request
    index: int
    detokenizer: IncrementalDetokenizer | None
    num_seen_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    final_text: str | None = None

    def absorb(self, new_logprobs: list[TokenLogprobs], tokenizer: Any) -> str | None:
        """Take the request's new tokens; return the stop string they complete, if any."""
        params = self.request.sampling_params
        if params.logprobs is None and self.detokenizer is None:
            return None  # nothing to do with the tokens
        new_tokens = self.request.output_token_ids[self.num_seen_tokens :]
        self.num_seen_tokens = self.request.num_output_tokens
        if params.logprobs is not None:
            self.logprobs = self.logprobs or []
            for entry in new_logprobs:
                self.logprobs.append(to_position_logprobs(entry, tokenizer))
                self.cumulative_logprob = (self.cumulative_logprob or 0.0) + entry.logprob
        if self.detokenizer is None or not new_tokens:
            return None
        old_length = len(self.detokenizer.text)
        self.detokenizer.add(new_tokens)
        return self._find_stop(old_length)

    def _find_stop(self, old_length: int) -> str | None:
        params = self.request.sampling_params
        if not params.stop or self.final_text is not None:
            return None
        text = self.detokenizer.text
        longest = max(len(s) for s in params.stop)
        window_start = max(0, old_length - longest + 1)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            at = text.find(stop, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.final_text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
        return stop

    def completion(self) -> CompletionOutput:
        request = self.request
        params = request.sampling_params
        if self.final_text is not None:
            text = self.final_text
        elif self.detokenizer is None:
            text = ""
        else:
            text = self.detokenizer.text
            if params.stop and not request.status.finished:
                # Hold back what could still become a stop string.
                text = text[: max(0, len(text) - (max(len(s) for s in params.stop) - 1))]
        # Positional arguments (in field order): a streamed request builds one every step.
        return CompletionOutput(
            self.index,
            text,
            list(request.output_token_ids),
            request.status.finish_reason,
            request.stop_reason,
            None if self.logprobs is None else list(self.logprobs),
            self.cumulative_logprob,
        )


@dataclass(slots=True)
class RequestState:
    """A user request: its samples (``n`` of them once forked) and prompt-side results.

    ``stream`` is False when the caller wants only the final output.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    stream: bool = True

    @property
    def sample_ids(self) -> list[str]:
        """The request's id and the ids its forks get (``<id>#<index>``)."""
        return [self.request_id, *(f"{self.request_id}#{i}" for i in range(1, self.params.n))]

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.params.n and all(
            s.request.status.finished for s in self.samples
        )

    def record_prompt_logprobs(
        self, first: int, entries: list[TokenLogprobs], tokenizer: Any
    ) -> None:
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        for offset, entry in enumerate(entries):
            self.prompt_logprobs[first + offset] = to_position_logprobs(entry, tokenizer)

    def output(self, error: str | None = None) -> RequestOutput:
        """The request as callers see it now; with ``error`` it is final and failed."""
        # One pass over the samples (this runs for every streamed request in every step).
        completions = []
        num_preemptions = 0
        samples_finished = len(self.samples) == self.params.n
        for sample in self.samples:
            completion = sample.completion()
            completions.append(completion)
            num_preemptions += sample.request.num_preemptions
            samples_finished = samples_finished and completion.finish_reason is not None
        first = self.samples[0].request
        self.metrics.num_cached_tokens = first.num_cached_tokens
        self.metrics.num_preemptions = num_preemptions
        self.metrics.scheduled_time = first.scheduled_time or None
        return RequestOutput(  # positional, in field order, as above
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            samples_finished or error is not None,
            self.metrics,
            self.prompt_logprobs,
            first.num_cached_tokens,
            error,
            first.kv_transfer_result,
        )
