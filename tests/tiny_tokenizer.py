"""A small byte-level BPE tokenizer trained in-process, deterministic, for text tests."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "A quick brown fox jumps over the lazy dog, again and again.",
    "Continuous batching keeps the accelerator busy; paged attention keeps memory tidy.",
    "Grüße aus Köln! 東京は日本の首都です。 Emoji: 🚀✨",
] * 20


def save_tiny_tokenizer(directory: Path, vocab_size: int = 300) -> None:
    """Train a byte-level BPE of at most ``vocab_size`` tokens and save it HF-style."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    wrapped.save_pretrained(directory)
