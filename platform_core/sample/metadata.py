"""Per-step sampling parameters of the batch, gathered into tensors once.

Rows are *samples*: a request forking into ``n`` samples on its first token contributes ``n``
rows that share one logits row (``logits_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from platform_core.sampling_params import SamplingParams


class SampleSource(Protocol):
    """What sampling reads of a row: a ``SampleRow``, or a ``ScheduledRequest`` (one row per
    request in the common step, with no row objects to build)."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(slots=True, kw_only=True)
class SampleRow:
    """One row to sample: the request (or fork child) id, its params and its token history."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(slots=True)
class RandomSampling:
    """Per-row tensors for drawing at random; greedy rows hold neutral values (ignored)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    greedy_rows: torch.Tensor
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    generators: list[torch.Generator | None]


@dataclass(slots=True)
class SamplingMetadata:
    """Tensors and index lists describing every row's processing.

    Index lists are ``(rows, token_ids)`` pairs in coordinate form, so each processor is one
    batched tensor operation over the rows that need it. ``random`` is ``None`` when every row
    is greedy: such a batch needs no sampling tensors at all.
    """

    rows: Sequence[SampleSource]
    greedy: list[bool]
    random: RandomSampling | None
    allowed: tuple[list[int], list[int]] | None
    bias: tuple[list[int], list[int], list[float]] | None
    blocked: tuple[list[int], list[int]] | None
    penalty_rows: list[int]
    max_logprobs: int

    @property
    def all_greedy(self) -> bool:
        return self.random is None


class GeneratorStore:
    """One ``torch.Generator`` per seeded request, created on first use and dropped on finish."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def get(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(seed)
            self._generators[request_id] = generator
        return generator

    def drop(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def retain(self, request_ids: set[str]) -> None:
        """Forget generators of requests not in ``request_ids``."""
        self._generators = {k: v for k, v in self._generators.items() if k in request_ids}


def build_sampling_metadata(
    rows: Sequence[SampleSource],
    generators: GeneratorStore,
    eos_token_ids: frozenset[int],
    device: torch.device,
) -> SamplingMetadata:
    """Collect the rows' parameters into tensors and index lists on ``device``."""
    greedy: list[bool] = []
    allowed_rows: list[int] = []
    allowed_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    blocked_rows: list[int] = []
    blocked_ids: list[int] = []
    penalty_rows: list[int] = []
    max_logprobs = -1
    for i, row in enumerate(rows):
        p = row.sampling_params
        greedy.append(p.greedy)
        if p.allowed_token_ids is not None:
            allowed_rows += [i] * len(p.allowed_token_ids)
            allowed_ids += p.allowed_token_ids
        if p.logit_bias:
            bias_rows += [i] * len(p.logit_bias)
            bias_ids += list(p.logit_bias)
            bias_values += list(p.logit_bias.values())
        if p.min_tokens and len(row.output_token_ids) < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            blocked_rows += [i] * len(stops)
            blocked_ids += sorted(stops)
        if p.has_penalties:
            penalty_rows.append(i)
        if p.logprobs is not None and p.logprobs > max_logprobs:
            max_logprobs = p.logprobs
    return SamplingMetadata(
        rows=rows,
        greedy=greedy,
        random=None if all(greedy) else _random_sampling(rows, greedy, generators, device),
        allowed=(allowed_rows, allowed_ids) if allowed_rows else None,
        bias=(bias_rows, bias_ids, bias_values) if bias_rows else None,
        blocked=(blocked_rows, blocked_ids) if blocked_rows else None,
        penalty_rows=penalty_rows,
        max_logprobs=max_logprobs,
    )


def _random_sampling(
    rows: Sequence[SampleSource],
    greedy: list[bool],
    generators: GeneratorStore,
    device: torch.device,
) -> RandomSampling:
    params = [r.sampling_params for r in rows]

    def floats(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    return RandomSampling(
        temperature=floats([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        top_p=floats([p.top_p for p in params]),
        min_p=floats([p.min_p for p in params]),
        greedy_rows=torch.tensor(greedy, dtype=torch.bool, device=device),
        needs_top_k=any(p.top_k > 0 and not g for p, g in zip(params, greedy)),
        needs_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
        needs_min_p=any(p.min_p > 0.0 and not g for p, g in zip(params, greedy)),
        generators=[
            None if g else generators.get(r.request_id, r.sampling_params.seed)
            for r, g in zip(rows, greedy)
        ],
    )
