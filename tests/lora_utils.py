"""Random PEFT LoRA adapters for the tiny test models, made with peft itself."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL_TARGETS = ATTENTION + MLP


def make_adapter(
    hf_model: Any,
    path: Path,
    targets: Sequence[str],
    rank: int,
    seed: int,
    use_rslora: bool = False,
    scale: float = 0.1,
) -> Any:
    """Save a PEFT adapter of ``hf_model`` with seeded random A and B weights at ``path``;
    return the PEFT model (a copy of ``hf_model`` with the adapter, in eval mode).

    Both A and B are random (PEFT's own initialization zeroes B, which would change nothing),
    at a scale where the adapter changes the tiny models' greedy tokens.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(targets),
        lora_dropout=0.0,
        use_rslora=use_rslora,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(copy.deepcopy(hf_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if "lora_" in name:
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    peft_model.save_pretrained(path)
    return peft_model.eval()
