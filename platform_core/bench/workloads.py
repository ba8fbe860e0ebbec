"""Benchmark workloads: seeded random requests, a shared prefix, or a JSONL file.

Random prompts are token ids drawn from a ``TokenSpace`` (a vocabulary range minus the
tokenizer's special tokens), so no tokenizer round trip changes their length. Everything is drawn
from ``random.Random(seed)``: the same seed gives the same requests on any machine.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from platform_core.errors import PlatformCoreError


class WorkloadError(PlatformCoreError, ValueError):
    """A workload cannot be built (bad lengths, bad JSONL line, empty token space, ...)."""


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: a prompt as token ids and/or text, and how many tokens to generate."""

    max_tokens: int
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None

    @property
    def prompt_len(self) -> int | None:
        """The prompt's length in tokens when known without a tokenizer."""
        return None if self.prompt_token_ids is None else len(self.prompt_token_ids)

    def as_prompt(self) -> str | dict[str, Any]:
        """The prompt in the form ``LLM.generate`` takes."""
        if self.prompt_token_ids is None:
            return self.prompt or ""
        prompt: dict[str, Any] = {"prompt_token_ids": self.prompt_token_ids}
        if self.prompt is not None:
            prompt["prompt"] = self.prompt
        return prompt


@dataclass(frozen=True, slots=True)
class LengthRange:
    """Inclusive range of lengths; ``draw`` picks uniformly."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise WorkloadError(
                f"a length range needs 1 <= low <= high, got {self.low}:{self.high}"
            )

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """``"128"`` (fixed) or ``"32:512"`` (uniform, both ends included)."""
        low, _, high = text.partition(":")
        try:
            return cls(int(low), int(high or low))
        except ValueError as exc:
            raise WorkloadError(f"bad length {text!r}: expected N or LOW:HIGH") from exc

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return f"{self.low}:{self.high}"


@dataclass(frozen=True, slots=True)
class TokenSpace:
    """Token ids random prompts draw from: ``[low, high)`` without ``excluded``."""

    low: int
    high: int
    excluded: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, text: str) -> TokenSpace:
        """``"LOW:HIGH"`` (high excluded)."""
        low, sep, high = text.partition(":")
        try:
            if not sep:
                raise ValueError(text)
            return cls(int(low), int(high))
        except ValueError as exc:
            raise WorkloadError(f"bad token id range {text!r}: expected LOW:HIGH") from exc

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int) -> TokenSpace:
        """The model's vocabulary without special tokens (all of it when there is no tokenizer).

        Ids past the tokenizer's length (padded embedding rows) are left out: they decode to
        nothing a server could return.
        """
        if tokenizer is None:
            return cls(0, vocab_size)
        high = min(vocab_size, len(tokenizer))
        return cls(0, high, frozenset(tokenizer.all_special_ids))

    def __str__(self) -> str:
        return f"{self.low}:{self.high} without {len(self.excluded)} special ids"

    def candidates(self) -> list[int]:
        ids = [t for t in range(self.low, self.high) if t not in self.excluded]
        if not ids:
            raise WorkloadError(f"no token ids to draw from in [{self.low}, {self.high})")
        return ids


def random_requests(
    num: int,
    input_len: LengthRange,
    output_len: LengthRange,
    tokens: TokenSpace,
    seed: int = 0,
) -> list[BenchRequest]:
    """``num`` requests of random token ids with lengths drawn from the two ranges."""
    rng = random.Random(seed)
    ids = tokens.candidates()
    requests = []
    for _ in range(num):
        length = input_len.draw(rng)
        requests.append(BenchRequest(output_len.draw(rng), rng.choices(ids, k=length)))
    return requests


def shared_prefix_requests(
    num: int,
    prefix_len: int,
    suffix_len: int,
    output_len: LengthRange,
    tokens: TokenSpace,
    seed: int = 0,
) -> list[BenchRequest]:
    """``num`` requests: one random prefix of ``prefix_len`` tokens, then a unique suffix each."""
    if prefix_len < 0 or suffix_len < 1:
        raise WorkloadError(
            "shared-prefix needs prefix_len >= 0 and suffix_len >= 1; "
            f"got {prefix_len} and {suffix_len}"
        )
    rng = random.Random(seed)
    ids = tokens.candidates()
    if len(ids) ** suffix_len < num:
        raise WorkloadError(f"{num} unique suffixes of {suffix_len} tokens do not exist")
    prefix = rng.choices(ids, k=prefix_len)
    seen: set[tuple[int, ...]] = set()
    requests = []
    while len(requests) < num:
        suffix = tuple(rng.choices(ids, k=suffix_len))
        if suffix in seen:
            continue
        seen.add(suffix)
        requests.append(BenchRequest(output_len.draw(rng), prefix + list(suffix)))
    return requests


def load_jsonl(path: str | Path) -> list[BenchRequest]:
    """One request per line: ``{"prompt_token_ids": [...] | "prompt": "...", "max_tokens": N}``.

    Blank lines are skipped; other keys are ignored. An invalid line raises ``WorkloadError``
    naming the file and line.
    """
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                requests.append(_parse_line(line))
            except (ValueError, TypeError) as exc:
                raise WorkloadError(f"{path}:{number}: {exc}") from exc
    if not requests:
        raise WorkloadError(f"{path}: no requests")
    return requests


def _parse_line(line: str) -> BenchRequest:
    entry = json.loads(line)
    if not isinstance(entry, dict):
        raise ValueError("expected a JSON object")
    ids, prompt, max_tokens = (entry.get(k) for k in ("prompt_token_ids", "prompt", "max_tokens"))
    if ids is None and prompt is None:
        raise ValueError("needs 'prompt_token_ids' or 'prompt'")
    if ids is not None and not (
        isinstance(ids, list) and ids and all(_is_int(t) and t >= 0 for t in ids)
    ):
        raise ValueError("'prompt_token_ids' must be a non-empty list of non-negative integers")
    if prompt is not None and not (isinstance(prompt, str) and prompt):
        raise ValueError("'prompt' must be a non-empty string")
    if not (_is_int(max_tokens) and max_tokens >= 1):
        raise ValueError(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    return BenchRequest(max_tokens, ids, prompt)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
