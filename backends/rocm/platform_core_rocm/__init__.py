"""platform-core's AMD ROCm backend: shared Triton paged attention, RCCL collectives."""

__version__ = "0.1.0"
