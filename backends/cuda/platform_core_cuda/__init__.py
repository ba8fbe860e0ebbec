"""platform-core's NVIDIA backend: shared Triton paged attention, CUDA graphs, NCCL."""

__version__ = "0.1.0"
