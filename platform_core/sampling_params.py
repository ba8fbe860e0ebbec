"""Per-request sampling controls, validated on construction (the vLLM / OpenAI set)."""

from __future__ import annotations

import copy
import math
from array import array
from dataclasses import dataclass, field

from platform_core.errors import InvalidRequestError
from platform_core.structured_outputs_params import StructuredOutputsParams

MAX_LOGPROBS = 20
_INT64 = 2**63
_SEED_SPAN = 2 * _INT64 - 1  # how many seeds are valid: the integers in (-2**63, 2**63)


def _check(ok: bool, name: str, valid: str, value: object) -> None:
    if not ok:
        raise InvalidRequestError(f"{name} must be {valid}, got {value!r}", param=name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's continuation.

    Order of logit processing (each row with its own values): ``allowed_token_ids`` mask,
    ``logit_bias``, ``min_tokens`` (EOS and stop tokens blocked), repetition / frequency /
    presence penalties, then ``temperature``, ``min_p``, ``top_k``, ``top_p`` and sampling.
    ``temperature == 0`` (or ``top_k == 1``) is greedy: the argmax after penalties and biases.

    ``logprobs`` returns, per generated token, the ``logprobs`` most likely tokens plus the
    sampled one; ``prompt_logprobs`` does the same for prompt positions. As in the OpenAI API and
    vLLM, these are the model's raw log-probabilities (log-softmax of the logits before
    temperature, penalties or filtering), so they do not depend on the sampling settings.

    Generation stops at ``max_tokens``, at EOS (unless ``ignore_eos``), at any ``stop_token_ids``,
    or when the text ends in one of ``stop`` (cut off unless ``include_stop_str_in_output``).
    ``seed`` makes a request's samples reproducible whatever else is in the batch.
    ``structured_outputs`` constrains the output to a JSON schema, regex, choice or grammar
    (a ``StructuredOutputsParams``, or the mapping of its fields); the constraint's mask is
    applied before everything else.

    Token id lists are normalized once here, so per-step work never depends on how long (or
    repetitive) the caller's lists were: ``stop_token_ids`` and ``allowed_token_ids`` lose their
    duplicates (first occurrence kept), ``stop_token_set`` answers membership, and
    ``stop_token_array`` / ``allowed_token_array`` / ``logit_bias_ids`` / ``logit_bias_values``
    hold the same values as contiguous buffers that the sampler wraps as tensors without
    copying. Treat an instance as immutable once built.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)
    stop_token_array: array = field(init=False, repr=False, compare=False)
    allowed_token_array: array | None = field(init=False, repr=False, compare=False)
    logit_bias_ids: array = field(init=False, repr=False, compare=False)
    logit_bias_values: array = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.top_k == 0:
            self.top_k = -1
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._validate()
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        self.stop_token_set = frozenset(self.stop_token_ids)
        self.stop_token_array = array("q", self.stop_token_ids)
        if self.allowed_token_ids is None:
            self.allowed_token_array = None
        else:
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
            self.allowed_token_array = array("q", self.allowed_token_ids)
        self.logit_bias_ids = array("q", self.logit_bias)
        self.logit_bias_values = array("f", self.logit_bias.values())

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0.0,
            "temperature",
            "a finite number >= 0",
            self.temperature,
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(
            _is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k < _INT64),
            "top_k",
            "-1 or 0 (disabled) or an integer >= 1",
            self.top_k,
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        _check(
            self.seed is None or (_is_int(self.seed) and abs(self.seed) < _INT64),
            "seed",
            "None or an integer in (-2**63, 2**63)",
            self.seed,
        )
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            "None or an integer >= 1",
            self.max_tokens,
        )
        _check(
            _is_int(self.min_tokens)
            and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
            "min_tokens",
            "an integer in [0, max_tokens]",
            self.min_tokens,
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a list of non-empty strings",
            self.stop,
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"None or an integer in [0, {MAX_LOGPROBS}]",
                value,
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, "in [-2, 2]", value)
        _check(
            0.0 < self.repetition_penalty <= 2.0 or self.repetition_penalty == 1.0,
            "repetition_penalty",
            "in (0, 2]",
            self.repetition_penalty,
        )
        _check(
            all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()),
            "logit_bias",
            "a map of token id to a bias in [-100, 100]",
            self.logit_bias,
        )
        _check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
            "allowed_token_ids",
            "None or a non-empty list of token ids",
            self.allowed_token_ids,
        )
        # The vocabulary is checked at admission (``validate_token_ids``); int64 is checked here
        # because the ids are packed into int64 buffers below.
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias)),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ):
            bad = [t for t in ids if not (_is_int(t) and 0 <= t < _INT64)]
            _check(not bad, name, "non-negative integer token ids", bad[:5])
        _check(
            not self.stop or self.detokenize,
            "stop",
            "empty when detokenize is False (stop strings match text)",
            self.stop,
        )

    @property
    def greedy(self) -> bool:
        """True when the most likely token (after penalties and biases) is always taken."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate_token_ids(self, vocab_size: int) -> None:
        """Reject token ids the model cannot produce."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias)),
            ("allowed_token_ids", self.allowed_token_ids or []),
        ):
            bad = [t for t in ids if not (_is_int(t) and 0 <= t < vocab_size)]
            _check(not bad, name, f"token ids in [0, {vocab_size})", bad[:5])

    def clone_for_sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of an ``n > 1`` request (own seed, ``n = 1``).

        The seed is ``seed + index`` wrapped into the valid range, so every valid seed forks
        into valid, distinct, deterministic seeds (``2**63 - 1`` forks into ``-2**63 + 1``...).
        A shallow copy: the (immutable) id lists and buffers are shared, not rebuilt.
        """
        clone = copy.copy(self)
        clone.n = 1
        if self.seed is not None:
            clone.seed = (self.seed + index + _INT64 - 1) % _SEED_SPAN - (_INT64 - 1)
        return clone
