"""Greedy generations of the backend judged against HF transformers' float32 model.

The reference is teacher-forced on the backend's own tokens, so each step is judged on its own:
the backend's token must be the reference's argmax, or within the dtype's logprob tolerance of
it (a near-tie that rounding in a narrower dtype may flip), and its reported logprob must match
the reference's logprob of that token. The first step that fails is reported as "backend vs
reference: first divergence at token k of prompt p", with both tokens and their logprobs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Generated-token rows of HF's log-probabilities for (prompt, backend tokens), [len, vocab].
Reference = Callable[[list[int], list[int]], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Generation:
    """One completion: its prompt's index, its tokens and the logprob reported for each."""

    prompt_index: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]


@dataclass(frozen=True, slots=True)
class Verdict:
    """The worst logprob error over all completions and the first failure, if any."""

    max_logprob_error: float
    failure: str | None


def _step_failure(
    gen: Generation, step: int, rows: torch.Tensor, atol: float, blocked: frozenset[int]
) -> str | None:
    ours, reported = gen.tokens[step], gen.logprobs[step]
    row = rows[step].clone()
    where = f"token {step} of prompt {gen.prompt_index} (prompt length {len(gen.prompt)})"
    if not math.isfinite(reported):
        return f"backend vs reference: non-finite logprob {reported} at {where}"
    row[list(blocked)] = -math.inf  # e.g. EOS before min_tokens: neither side may pick it
    best = int(row.argmax())
    if float(row[best] - row[ours]) > atol:
        return (
            f"backend vs reference: first divergence at {where}: backend chose {ours} "
            f"(reference logprob {float(rows[step, ours]):.4f}), reference chose {best} "
            f"(logprob {float(rows[step, best]):.4f}); allowed margin {atol:g}"
        )
    error = abs(reported - float(rows[step, ours]))
    if error > atol:
        return (
            f"backend vs reference: logprob of token {ours} at {where}: backend "
            f"{reported:.4f} vs reference {float(rows[step, ours]):.4f} (tolerance {atol:g})"
        )
    return None


def judge(
    generations: Sequence[Generation],
    reference: Reference,
    atol: float,
    blocked: frozenset[int] = frozenset(),
) -> Verdict:
    """Check every completion step by step; ``blocked`` tokens could not be generated."""
    worst, failure = 0.0, None
    for gen in generations:
        rows = reference(gen.prompt, gen.tokens)
        for step, token in enumerate(gen.tokens):
            if math.isfinite(gen.logprobs[step]):
                worst = max(worst, abs(gen.logprobs[step] - float(rows[step, token])))
            failure = failure or _step_failure(gen, step, rows, atol, blocked)
    return Verdict(worst, failure)
