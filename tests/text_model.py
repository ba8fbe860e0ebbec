"""A tiny seeded Llama with a real (tiny, trained) tokenizer and a ChatML template."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny_tokenizer import save_tiny_tokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def save_text_model(directory: Path, seed: int = 0) -> Path:
    """Write config, seeded safetensors weights, tokenizer and chat template to ``directory``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    save_tiny_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.copy_(0.15 * torch.randn(param.shape, generator=generator))
            if param.dim() == 1:
                param.add_(1.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
