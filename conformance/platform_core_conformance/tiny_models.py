"""Tiny seeded HF models for the end-to-end checks, and HF transformers' greedy tokens.

Each model is built from a config (never downloaded), given deterministic weights of a useful
scale, and saved with ``save_pretrained`` so the engine's real loading code runs. The head size
is a parameter: the suite picks one the backend declares.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 256
NUM_HEADS, NUM_KV_HEADS = 4, 2
# name -> (transformers model_type, architecture)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),  # q/k/v projections with biases
}


def tiny_config(arch: str, head_size: int) -> Any:
    """The transformers config of a two-layer GQA model whose heads have ``head_size``."""
    from transformers import AutoConfig

    model_type, architecture = ARCHITECTURES[arch]
    hidden = NUM_HEADS * head_size
    return AutoConfig.for_model(
        model_type,
        architectures=[architecture],
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def build_tiny_model(arch: str, head_size: int, seed: int = 0) -> Any:
    """A float32 HF model (eager attention, eval mode) with seeded weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(arch, head_size), dtype=torch.float32, attn_implementation="eager"
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            # Norm weights near 1, everything else small: activations neither vanish nor explode.
            param.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
    return model.eval()


@dataclass
class TinyModel:
    """A saved tiny model and the in-memory HF model it was saved from (the reference)."""

    arch: str
    head_size: int
    path: Path
    hf_model: Any


def save_tiny_model(arch: str, head_size: int, directory: Path) -> TinyModel:
    """Build the model and ``save_pretrained`` it (safetensors) into ``directory``."""
    model = build_tiny_model(arch, head_size)
    model.save_pretrained(directory, safe_serialization=True)
    return TinyModel(arch, head_size, directory, model)


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of the given lengths; ids 3.. avoid the pad, BOS and EOS tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """HF transformers' greedy continuation of ``prompt`` and each chosen token's logprob."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        float(torch.log_softmax(step_logits[0].float(), dim=-1)[token])
        for step_logits, token in zip(out.logits, tokens)
    ]
    return tokens, logprobs
