"""Seeded random Llama checkpoints for benchmarks: same shape and weights on every machine.

Speed does not depend on what the weights say, only on the shapes; the weights are still seeded so
greedy outputs can be compared across engines. Saved with ``save_pretrained`` (safetensors) so
every engine loads it the ordinary way. No tokenizer is saved: workloads are token ids.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class RandomLlamaSpec:
    """Shape of the random model (defaults: the benchmark issue's ~56M-parameter Llama)."""

    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 1408
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    dtype: str = "bfloat16"
    seed: int = 0


# Special ids written into the config; random prompts leave them out.
BOS_ID, EOS_ID, PAD_ID = 1, 2, 0


def build_random_llama(path: str | Path, spec: RandomLlamaSpec = RandomLlamaSpec()) -> Path:
    """Save the model for ``spec`` in ``path`` unless a matching one is already there."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    stamp = path / "random_llama_spec.json"
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(spec):
        return path
    config = LlamaConfig(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)  # transformers' seeded init: std 0.02 normal, unit norms
    model = model.to(getattr(torch, spec.dtype)).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    stamp.write_text(json.dumps(asdict(spec)))
    return path
