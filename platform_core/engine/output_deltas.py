"""Cumulative ``RequestOutput``s to a step's deltas, in the engine core (``DeltaWriter``).

The engine builds a cumulative output per request and step; sending it whole would cost
quadratic bytes over a request's life. ``DeltaWriter`` remembers what it sent of each request
and writes only what is new, one ``StepDeltas`` per step: the usual request (its one sample
grew, nothing else changed) as entries in flat columns, any other as a full ``RequestDelta``.
``output_assembly.OutputAssembler`` rebuilds the outputs on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from platform_core.engine.core_messages import CompletionDelta, RequestDelta, StepDeltas
from platform_core.engine.outputs import RequestMetrics, RequestOutput
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
    num_cached_tokens: int = 0
    samples: dict[int, _SentSample] = field(default_factory=dict)
    # Sample 0 when it is the only one sent (the receiver holds just that one), set by a full
    # delta (which sent the prompt ids): a request whose step only extends it goes in the
    # columns.
    only: _SentSample | None = None


# What an output of a request never expected is written against (it never goes in the columns).
_UNTRACKED = _SentRequest(False)


def _metrics_key(metrics: RequestMetrics | None) -> tuple | None:
    """What of ``metrics`` changes while a request runs (``arrival_time`` does not)."""
    if metrics is None:
        return None
    return (
        metrics.scheduled_time,
        metrics.first_token_time,
        metrics.finished_time,
        metrics.num_cached_tokens,
        metrics.num_preemptions,
    )


class DeltaWriter:
    """The engine-core side: what each request's receiver already has."""

    def __init__(self) -> None:
        self._sent: dict[str, _SentRequest] = {}

    def expect(self, request: GenerateRequest) -> None:
        """Track ``request`` (accepted); its prompt ids go out once if the client sent text."""
        self._sent[request.request_id] = _SentRequest(request.prompt_token_ids is None)

    def write(self, outputs: list[RequestOutput]) -> StepDeltas:
        """What ``outputs`` (one step's, one per request) add to what was sent; finished
        requests are forgotten.

        This runs for every running request in every step, in the engine core: the usual
        request is one pass of inline checks and appends, no helper calls but one (they show
        in the per-step cost, ``benchmarks/engine_transport.py``).
        """
        step = StepDeltas([], [], [], [], [], [], [])
        request_ids, counts, token_ids = step.request_ids, step.token_counts, step.token_ids
        texts, logprobs_of, cumulative = step.texts, step.logprobs, step.cumulative_logprobs
        sent_of = self._sent
        for output in outputs:
            sent = sent_of.get(output.request_id, _UNTRACKED)
            sample = sent.only
            completions = output.outputs
            if (
                sample is not None
                and len(completions) == 1
                and (completion := completions[0]).index == 0
                and completion.finish_reason is None
                and completion.stop_reason is None
                and completion.text.startswith(sample.text)
                and not output.finished
                and output.kv_transfer_params is None
                and output.error is None
                and output.num_cached_tokens == sent.num_cached_tokens
                and (output.prompt_logprobs is None or not sent.prompt_logprobs_due)
                and _metrics_key(output.metrics) in (None, sent.metrics)
            ):
                text, tokens, logprobs = completion.text, completion.token_ids, completion.logprobs
                request_ids.append(output.request_id)
                counts.append(len(tokens) - sample.tokens)
                token_ids += tokens[sample.tokens :]
                texts.append(text[len(sample.text) :])
                if logprobs is None:
                    logprobs_of.append(None)
                else:
                    logprobs_of.append(logprobs[sample.logprobs :])
                    sample.logprobs = len(logprobs)
                cumulative.append(completion.cumulative_logprob)
                sample.tokens, sample.text = len(tokens), text
                continue
            step.others.append(self._delta(output, sent))
        return step

    def _delta(self, output: RequestOutput, sent: _SentRequest) -> RequestDelta:
        """``output`` as a full delta against what was ``sent``."""
        if sent is _UNTRACKED:
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
        sent.only = samples.get(0) if len(samples) == 1 else None
        metrics = output.metrics
        key = _metrics_key(metrics)
        if key is None or key == sent.metrics:
            metrics = None  # unchanged, as in most steps
        else:
            sent.metrics = key
        prompt_ids = None
        if sent.prompt_ids_due:
            prompt_ids, sent.prompt_ids_due = output.prompt_token_ids, False
        prompt_logprobs = None
        if sent.prompt_logprobs_due and output.prompt_logprobs is not None:
            prompt_logprobs, sent.prompt_logprobs_due = output.prompt_logprobs, False
        sent.num_cached_tokens = output.num_cached_tokens
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
            output.kv_transfer_params,
        )

    def forget(self, request_ids: list[str]) -> None:
        """Stop tracking requests that will send nothing more (aborted)."""
        for request_id in request_ids:
            self._sent.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._sent)
