"""What the engine returns to callers, one ``RequestOutput`` per request and step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (``index`` tells which when ``n > 1``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timings of one request, in seconds since the epoch (``None`` until reached)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step; ``finished`` on its last one."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    extra: dict = field(default_factory=dict)
