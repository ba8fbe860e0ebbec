"""Paged KV-cache bookkeeping: block pool, prefix hashing, per-request block tables. No torch."""
