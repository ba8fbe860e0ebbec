"""Continuous-batching scheduler: pure Python, no torch."""
