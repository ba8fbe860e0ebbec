"""Per-request sampling controls, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from platform_core.errors import InvalidRequestError


def _check(ok: bool, name: str, valid: str, value: object) -> None:
    if not ok:
        raise InvalidRequestError(f"{name} must be {valid}, got {value!r}", param=name)


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's continuation.

    ``temperature == 0`` is greedy. ``top_k`` of ``-1`` (or 0) disables top-k; ``top_p == 1``
    disables nucleus sampling. ``seed`` makes a request's samples reproducible whatever else is in
    the batch. Generation stops at ``max_tokens``, at an EOS token (unless ``ignore_eos``), or at
    any of ``stop_token_ids``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True

    def __post_init__(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        _check(self.temperature >= 0.0, "temperature", ">= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
            "top_k",
            "-1 (disabled), 0 (disabled) or a positive integer",
            self.top_k,
        )
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            "None or an integer >= 1",
            self.max_tokens,
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of non-negative token ids",
            self.stop_token_ids,
        )
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature == 0.0 or self.top_k == 1

    def validate_token_ids(self, vocab_size: int) -> None:
        """Reject token ids the model cannot produce."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _check(not bad, "stop_token_ids", f"token ids below the vocabulary size {vocab_size}", bad)
