"""HF transformers ``generate`` as the always-available baseline: static batching.

Requests run in input order, ``batch_size`` at a time, left-padded to the longest prompt of their
batch. Each batch generates greedily for the longest ``max_tokens`` in it, with
``min_new_tokens`` equal to that so EOS cannot end it early (the EOS-ignoring equivalent). Only the
tokens each request asked for are counted: the extra steps a short request rides along for are the
cost of static batching, which is what this baseline exists to show.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from platform_core.bench.comparison import EngineRun, timed_run
from platform_core.bench.workloads import BenchRequest

ENGINE = "hf-transformers"


def _generate_batch(model: torch.nn.Module, batch: list[BenchRequest], pad_id: int) -> None:
    width = max(len(r.prompt_token_ids or []) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        ids = request.prompt_token_ids or []
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        mask[row, width - len(ids) :] = 1
    new_tokens = max(r.max_tokens for r in batch)
    output = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    if output.shape[1] - width != new_tokens:
        raise RuntimeError(f"HF generated {output.shape[1] - width} tokens, wanted {new_tokens}")


@torch.inference_mode()
def run_hf(
    model_dir: str | Path,
    requests: list[BenchRequest],
    warmup: list[BenchRequest],
    dtype: str = "bfloat16",
    batch_size: int = 8,
) -> EngineRun:
    """Time static-batched ``generate`` over ``requests`` (after an untimed ``warmup`` batch)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), local_files_only=True
    ).eval()
    pad_id = model.config.pad_token_id
    if pad_id is None:
        pad_id = 0
    _generate_batch(model, warmup, pad_id)
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        _generate_batch(model, requests[i : i + batch_size], pad_id)
    elapsed = time.perf_counter() - start
    note = f"static batches of {batch_size}, left padding, {model.config._attn_implementation}"
    return timed_run(ENGINE, requests, elapsed, note)
