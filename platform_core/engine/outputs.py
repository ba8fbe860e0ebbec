"""What the engine returns to callers, one ``RequestOutput`` per request and step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec


class Logprob(msgspec.Struct, array_like=True, gc=False):
    """A token's raw log-probability, its rank in the vocabulary, and its text if known.

    A msgspec struct rather than a dataclass: an engine-core process sends thousands per step
    (top logprobs of every running request), and as a struct each is a 3-item array on the
    wire, decoded without a field-name lookup.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# token id -> Logprob at one position (the chosen token plus the top alternatives)
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (``index`` tells which when ``n > 1``).

    While the request runs, ``text`` may lag the tokens by a few characters when stop strings are
    set: text that could still turn out to be the start of a stop string is held back.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timings of one request, in seconds since the epoch (``None`` until reached)."""

    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step; ``finished`` on its last one.

    ``prompt_logprobs[0]`` is ``None`` (the first token has no context); ``num_cached_tokens``
    counts prompt tokens served from the prefix cache. ``kv_transfer_params`` (on the final
    output) are what the KV connector tells the client, e.g. where a decode instance finds the
    prompt's blocks.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
