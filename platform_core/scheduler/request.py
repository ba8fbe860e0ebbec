"""One request's state machine: the gap between tokens known and tokens computed.

There are no prefill and decode phases: each step the scheduler grants a request ``k`` of its
uncomputed tokens. A prompt being chunked and a decode step are the same operation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from platform_core.lora_request import LoRARequest
from platform_core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        # By value: hashing an enum member runs Python code, a string's does not.
        return self._value_ in _FINISHED_VALUES

    @property
    def finish_reason(self) -> str | None:
        return self._value_ if self.finished else None  # `_value_`: `.value` is a slow descriptor


_FINISHED_VALUES = frozenset(
    s.value
    for s in (
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    )
)


@dataclass(eq=False, slots=True, kw_only=True)
class Request:
    """A sequence being generated.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; the scheduler moves it
    forward after each executed step and resets it to 0 on preemption. ``pending_fork_ids`` are
    the ids of the extra samples of an ``n > 1`` request, forked off when its first token is
    sampled. ``spec_token_ids`` are draft tokens proposed for the next step (speculative decoding),
    ``spec_draft_probs`` the proposer's distributions for them (opaque here; ``None`` when the
    proposer is deterministic). ``lora_request`` is the adapter it runs with (None: the base
    model). ``kv_transfer_params`` are the client's instructions to the KV connector (e.g. load
    the prompt's blocks from a prefill instance); ``kv_transfer_result`` what the connector
    returns to the client when the request finishes (e.g. where its blocks are held).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16
    arrival_time: float = 0.0
    scheduled_time: float = 0.0  # when first admitted to the running batch (0: not yet)
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    kv_transfer_params: dict[str, Any] | None = None
    kv_transfer_result: dict[str, Any] | None = None
    num_loading_tokens: int = 0  # remote tokens being loaded into its blocks
    kv_load_checked: bool = False  # its connector was asked for remote tokens
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    pending_fork_ids: list[str] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: Any = None
    stop_reason: int | str | None = None
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without building the whole list."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def num_seats(self) -> int:
        """Running slots this request will occupy once its samples fork."""
        return 1 + len(self.pending_fork_ids)

    def append_tokens(self, tokens: list[int]) -> RequestStatus | None:
        """Append sampled tokens one by one; the finished status of the first that ends the
        request (the rest are dropped), if any."""
        for token in tokens:
            self.output_token_ids.append(token)
            status = self.check_stop()
            if status is not None:
                return status
        return None

    def check_stop(self) -> RequestStatus | None:
        """The finished status the newest token causes, if any (records ``stop_reason``).

        EOS and stop tokens count only once ``min_tokens`` are out; the length limit always does.
        """
        last = self.output_token_ids[-1]
        num_output_tokens = len(self.output_token_ids)
        params = self.sampling_params
        if num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_set:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
