"""Per-step sampling parameters of the batch, gathered into tensors once.

Rows are *samples*: a request forking into ``n`` samples on its first token contributes ``n``
rows that share one logits row (``logits_rows``).
"""

from __future__ import annotations

from array import array
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
    token_bitmask: torch.Tensor | None


@dataclass(slots=True, kw_only=True)
class SampleRow:
    """One row to sample: the request (or fork child) id, its params, its token history and
    the bitmask of the tokens its constraint allows (``[1, words]``; None: unconstrained)."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    token_bitmask: torch.Tensor | None = None


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


# (row, token ids) per row that needs a processor; the ids are CPU int64 tensors viewing the
# request's own buffers (built once in ``SamplingParams``), so a step never copies id lists.
RowTokens = list[tuple[int, torch.Tensor]]


@dataclass(slots=True)
class SamplingMetadata:
    """Tensors and per-row token id tensors describing every row's processing.

    Each processor turns its ``RowTokens`` into one coordinate pair (rows, ids) and applies one
    batched tensor operation over the rows that need it; ``bias_values`` lines up with ``bias``.
    ``bitmask`` holds one row of allowed-token bits per constrained row, ``bitmask_rows`` which
    rows those are.
    ``random`` is ``None`` when every row is greedy: such a batch needs no sampling tensors.
    """

    rows: Sequence[SampleSource]
    greedy: list[bool]
    random: RandomSampling | None
    allowed: RowTokens | None
    bias: RowTokens | None
    bias_values: list[torch.Tensor] | None
    blocked: RowTokens | None
    penalty_rows: list[int]
    max_logprobs: int
    bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None

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
    """Collect the rows' parameters into tensors and per-row id tensors.

    The work per row does not depend on the length of its id lists (allowed ids, biases, stop
    ids): those are wrapped, not copied.
    """
    greedy: list[bool] = []
    allowed: RowTokens = []
    bias: RowTokens = []
    bias_values: list[torch.Tensor] = []
    blocked: RowTokens = []
    eos: torch.Tensor | None = None
    penalty_rows: list[int] = []
    max_logprobs = -1
    bitmasks: list[torch.Tensor] = []
    bitmask_rows: list[int] = []
    for i, row in enumerate(rows):
        p = row.sampling_params
        if row.token_bitmask is not None:
            bitmasks.append(row.token_bitmask)
            bitmask_rows.append(i)
        greedy.append(p.greedy)
        if p.allowed_token_array is not None:
            allowed.append((i, _view(p.allowed_token_array, torch.int64)))
        if p.logit_bias:
            bias.append((i, _view(p.logit_bias_ids, torch.int64)))
            bias_values.append(_view(p.logit_bias_values, torch.float32))
        if p.min_tokens and len(row.output_token_ids) < p.min_tokens:
            if p.stop_token_ids:
                blocked.append((i, _view(p.stop_token_array, torch.int64)))
            if not p.ignore_eos and eos_token_ids:
                if eos is None:
                    eos = torch.tensor(sorted(eos_token_ids), dtype=torch.int64)
                blocked.append((i, eos))
        if p.has_penalties:
            penalty_rows.append(i)
        if p.logprobs is not None and p.logprobs > max_logprobs:
            max_logprobs = p.logprobs
    return SamplingMetadata(
        rows=rows,
        greedy=greedy,
        random=None if all(greedy) else _random_sampling(rows, greedy, generators, device),
        allowed=allowed or None,
        bias=bias or None,
        bias_values=bias_values or None,
        blocked=blocked or None,
        penalty_rows=penalty_rows,
        max_logprobs=max_logprobs,
        bitmask=torch.cat(bitmasks).to(device) if bitmasks else None,
        bitmask_rows=torch.tensor(bitmask_rows, device=device) if bitmasks else None,
    )


def _view(values: array, dtype: torch.dtype) -> torch.Tensor:
    """A tensor sharing ``values``' memory (non-empty; read-only by convention)."""
    return torch.frombuffer(values, dtype=dtype)


def coordinates(row_tokens: RowTokens, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, token_ids)`` index tensors on ``device`` for a batched update of the logits."""
    ids = torch.cat([t for _, t in row_tokens])
    counts = torch.tensor([len(t) for _, t in row_tokens])
    rows = torch.repeat_interleave(torch.tensor([r for r, _ in row_tokens]), counts)
    return rows.to(device), ids.to(device)


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
