"""Executors: how the model's ranks run (one process, spawned workers, or Ray actors)."""
