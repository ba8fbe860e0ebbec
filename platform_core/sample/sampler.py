"""Batched sampler: one pass over the batch's logits applies each row's own parameters.

Sampling draws ``argmax(probs / E)`` with ``E ~ Exponential(1)`` per vocabulary entry, which picks
token ``t`` with probability ``probs[t]``. The noise of a seeded request comes from its own
generator, so its samples do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from platform_core.sample.metadata import SamplingMetadata
from platform_core.sample.processors import apply_allowed_bias_and_blocks, apply_penalties


@dataclass(slots=True)
class TokenLogprobs:
    """Raw log-probabilities at one position: the chosen token's, its rank, and the top ones."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SamplerOutput:
    """One token per row, and logprobs for rows that asked for them (``None`` otherwise)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Turns float32 logits ``[rows, vocab]`` into one token id per row."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw = logits
        logits = apply_allowed_bias_and_blocks(logits, meta)
        logits = apply_penalties(logits, meta)
        tokens = logits.argmax(dim=-1)
        if not meta.all_greedy:
            sampled = self._sample(logits, meta)
            tokens = torch.where(meta.greedy_rows, tokens, sampled)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_list)
        if meta.max_logprobs >= 0:
            wanted = [i for i, r in enumerate(meta.rows) if r.params.logprobs is not None]
            counts = [meta.rows[i].params.logprobs for i in wanted]
            found = compute_logprobs(raw[wanted], tokens[wanted], counts)
            for i, entry in zip(wanted, found):
                logprobs[i] = entry
        return SamplerOutput(token_list, logprobs)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = logits / meta.temperature.unsqueeze(1)
        if meta.needs_min_p:
            probs = torch.softmax(logits, dim=-1)
            floor = meta.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < floor, float("-inf"))
        if meta.needs_top_k or meta.needs_top_p:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p, meta.needs_top_p)
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, generator in enumerate(meta.generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        return (probs / noise).argmax(dim=-1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_top_p: bool = True
) -> torch.Tensor:
    """Mask to ``-inf`` every logit outside each row's top-k and top-p nucleus.

    ``top_k <= 0`` and ``top_p == 1`` leave a row unfiltered. The nucleus keeps the smallest set
    of most likely tokens whose probability reaches ``top_p`` (the most likely token always stays).
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = ranks >= k
    if use_top_p:
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def compute_logprobs(
    logits: torch.Tensor, chosen: torch.Tensor, counts: list[int]
) -> list[TokenLogprobs]:
    """Raw log-softmax logprobs of ``chosen`` tokens with each row's top ``counts[i]``."""
    if not counts:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    k = max(counts)
    top_values, top_ids = (
        logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], chosen[:, None][:, :0])
    )
    results = []
    for i, count in enumerate(counts):
        top = list(zip(top_ids[i, :count].tolist(), top_values[i, :count].tolist()))
        results.append(TokenLogprobs(int(chosen[i]), float(chosen_lp[i, 0]), int(ranks[i]), top))
    return results
