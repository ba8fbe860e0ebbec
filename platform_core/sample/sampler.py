"""Batched sampler: one pass over the batch's logits applies each row's own parameters.

Sampling draws ``argmax(probs / E)`` with ``E ~ Exponential(1)`` per vocabulary entry, which picks
token ``t`` with probability ``probs[t]``. The noise of a seeded request comes from its own
generator, so its samples do not depend on the rest of the batch.
"""

from __future__ import annotations

import torch

from platform_core.sample.metadata import SamplingMetadata


class Sampler:
    """Turns float32 logits ``[num_rows, vocab]`` into one token id per row."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy_tokens
        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.needs_top_k or metadata.needs_top_p:
            logits = apply_top_k_top_p(logits, metadata)
        probs = torch.softmax(logits, dim=-1)
        noise = self._exponential_noise(probs, metadata.generators)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(metadata.greedy_rows, greedy_tokens, sampled)

    def _exponential_noise(
        self, probs: torch.Tensor, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for row, generator in enumerate(generators):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        return noise


def apply_top_k_top_p(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Mask to ``-inf`` every logit outside each row's top-k and top-p nucleus.

    Rows with top-k disabled (``<= 0``) or ``top_p == 1`` are unaffected by that filter. The
    nucleus keeps the smallest set of most likely tokens whose probability reaches ``top_p``.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(metadata.top_k > 0, metadata.top_k, vocab).unsqueeze(1)
    drop = ranks >= k
    if metadata.needs_top_p:
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= metadata.top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
