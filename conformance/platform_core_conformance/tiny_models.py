"""Tiny seeded HF models for the end-to-end checks, and HF transformers' greedy tokens.

Each model is built from a config (never downloaded), given deterministic weights of a useful
scale, and saved with ``save_pretrained`` so the engine's real loading code runs. The head size
is a parameter (the suite covers the declared ones), and so is the embeddings' magnitude: large
activations overflow a float16 norm that squares in float16, tiny ones make a norm's epsilon
matter.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
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


def build_tiny_model(arch: str, head_size: int, seed: int = 0, magnitude: float = 1.0) -> Any:
    """A float32 HF model (eager attention, eval mode) with seeded weights; the embeddings (the
    first norm's input) are ``magnitude`` times larger than the other weights' scale."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(arch, head_size), dtype=torch.float32, attn_implementation="eager"
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            # Norm weights near 1; matrices scaled by fan-in (0.1 at 64 inputs), so activations
            # neither vanish nor explode at any head size; embeddings and biases 0.1.
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif param.dim() == 2 and not name.endswith("embed_tokens.weight"):
                param.copy_(0.8 * param.shape[1] ** -0.5 * noise)
            else:
                param.copy_(0.1 * noise)
            if name.endswith("embed_tokens.weight"):
                param.mul_(magnitude)
    return model.eval()


@dataclass
class TinyModel:
    """A saved tiny model and the in-memory HF model it was saved from (the reference)."""

    arch: str
    head_size: int
    path: Path
    hf_model: Any
    magnitude: float = 1.0
    _rounded: dict[str, Any] = field(default_factory=dict, repr=False)

    def reference(self, dtype: torch.dtype) -> Any:
        """The HF model computing in float32 from weights rounded to ``dtype`` (what the backend
        loads), so the comparison measures the backend's arithmetic, not the weights' rounding."""
        if dtype == torch.float32:
            return self.hf_model
        key = str(dtype)
        if key not in self._rounded:
            model = copy.deepcopy(self.hf_model)
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(param.to(dtype).float())
            self._rounded[key] = model
        return self._rounded[key]

    @property
    def label(self) -> str:
        scale = "" if self.magnitude == 1.0 else f" (embeddings x{self.magnitude:g})"
        return f"{self.arch} h{self.head_size}{scale}"


def save_tiny_model(
    arch: str, head_size: int, directory: Path, magnitude: float = 1.0
) -> TinyModel:
    """Build the model and ``save_pretrained`` it (safetensors) into ``directory``."""
    model = build_tiny_model(arch, head_size, magnitude=magnitude)
    model.save_pretrained(directory, safe_serialization=True)
    return TinyModel(arch, head_size, directory, model, magnitude)


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of the given lengths; ids 3.. avoid the pad, BOS and EOS tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def hf_logprob_rows(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """HF transformers' (float32) log-probabilities ``[len(tokens), vocab]`` of each position a
    continuation ``tokens`` of ``prompt`` was generated at (teacher forcing on ``tokens``)."""
    ids = torch.tensor([prompt + tokens[:-1]])
    logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)
