"""Batched sampling from logits, every request with its own parameters, and the lossless
verification of speculative drafts against the target's distribution."""
