"""Batched sampling from logits, every request with its own parameters."""
