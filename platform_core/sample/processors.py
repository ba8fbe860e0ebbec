"""Logit processors: masks, biases and penalties, each one batched tensor operation.

Every function takes float32 logits ``[rows, vocab]`` (the sampler widens narrower ones first)
and returns processed logits; rows that do not ask for a processor are untouched.
"""

from __future__ import annotations

import torch

from platform_core.sample.metadata import SamplingMetadata, coordinates


def apply_allowed_bias_and_blocks(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """``allowed_token_ids`` masks, ``logit_bias`` additions and ``min_tokens`` EOS blocking."""
    device = logits.device
    if meta.allowed is not None:
        rows, ids = coordinates(meta.allowed, device)
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[rows, ids] = True
        restricted = torch.zeros(logits.shape[0], dtype=torch.bool, device=device)
        restricted[rows] = True
        logits = logits.masked_fill(restricted.unsqueeze(1) & ~keep, float("-inf"))
    if meta.bias is not None:
        rows, ids = coordinates(meta.bias, device)
        values = torch.cat(meta.bias_values).to(device=device, dtype=logits.dtype)
        logits = logits.index_put((rows, ids), values, accumulate=True)
    if meta.blocked is not None:
        rows, ids = coordinates(meta.blocked, device)
        logits = logits.clone()
        logits[rows, ids] = float("-inf")
    return logits


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``counts[i, t]``: occurrences of token ``t`` in ``token_lists[i]``."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.int64)
    for i, tokens in enumerate(token_lists):
        padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    counts = torch.zeros((len(token_lists), vocab + 1), dtype=torch.float32)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab].to(device)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output tokens), frequency and presence (output tokens) penalties.

    Repetition divides positive and multiplies negative logits of seen tokens by the penalty;
    frequency subtracts ``penalty * count`` and presence subtracts ``penalty`` once per seen token.
    """
    rows = meta.penalty_rows
    if not rows:
        return logits
    vocab = logits.shape[1]
    chosen = [meta.rows[i] for i in rows]
    params = [r.sampling_params for r in chosen]
    device = logits.device
    sub = logits[rows]
    output_counts = _token_counts([r.output_token_ids for r in chosen], vocab, device)
    prompt_seen = _token_counts([r.prompt_token_ids for r in chosen], vocab, device) > 0
    seen = prompt_seen | (output_counts > 0)
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalized, sub)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    sub = sub - frequency * output_counts - presence * (output_counts > 0).float()
    logits = logits.clone()
    logits[rows] = sub
    return logits
