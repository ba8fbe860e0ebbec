"""Verifying draft tokens against the target model's distribution, lossless.

Each group is one request's rows: row ``i`` holds the target's logits after the request's tokens
and drafts ``d[:i]``. Greedy rows accept drafts while they equal the target's argmax. Random rows
use rejection sampling: draft ``d`` proposed with probability ``q(d)`` is accepted with
probability ``min(1, p(d) / q(d))``; on rejection a token is drawn from the residual
``max(p - q, 0)`` (normalized). With ``q`` a point mass (prompt lookup) that is ``p`` without
``d``. Accepting every draft earns one more token from the last row (the bonus), so a group of
``k`` drafts always yields between 1 and ``k + 1`` tokens whose distribution equals sampling from
the target alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from platform_core.sample.metadata import SamplingMetadata
from platform_core.sample.sampler import Sampler


@dataclass(slots=True)
class DraftGroup:
    """One request's rows ``first .. first + len(drafts)`` and its drafts.

    ``draft_probs`` (``[len(drafts), vocab]``) is the proposer's distribution per draft, or
    ``None`` for a deterministic proposer.
    """

    first: int
    drafts: list[int]
    draft_probs: torch.Tensor | None = None


def verify(
    sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, groups: list[DraftGroup]
) -> list[list[int]]:
    """The accepted tokens (drafts kept plus one target token) of every group."""
    processed = sampler.process(logits, meta)
    greedy_tokens = sampler.argmax(processed).tolist()
    probs = None if meta.all_greedy else sampler.probabilities(processed, meta)
    results = []
    for group in groups:
        if meta.greedy[group.first]:
            results.append(_verify_greedy(group, greedy_tokens))
        else:
            results.append(_verify_random(sampler, group, probs, meta))
    return results


def _verify_greedy(group: DraftGroup, targets: list[int]) -> list[int]:
    accepted = []
    for i, draft in enumerate(group.drafts):
        if targets[group.first + i] != draft:
            break
        accepted.append(draft)
    return [*accepted, targets[group.first + len(accepted)]]


def _verify_random(
    sampler: Sampler, group: DraftGroup, probs: torch.Tensor, meta: SamplingMetadata
) -> list[int]:
    generator = meta.random.generators[group.first]
    accepted: list[int] = []
    for i, draft in enumerate(group.drafts):
        row = probs[group.first + i]
        proposed = 1.0 if group.draft_probs is None else float(group.draft_probs[i, draft])
        if sampler.uniform(generator) * proposed < float(row[draft]):
            accepted.append(draft)
            continue
        if group.draft_probs is None:
            residual = row.clone()
            residual[draft] = 0.0
        else:
            residual = (row - group.draft_probs[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p equals q exactly: any draw from p is correct
            residual = row
        token = sampler.draw((residual / residual.sum()).unsqueeze(0), [generator])
        return [*accepted, int(token[0])]
    last = probs[group.first + len(accepted)].unsqueeze(0)
    return [*accepted, int(sampler.draw(last, [generator])[0])]
