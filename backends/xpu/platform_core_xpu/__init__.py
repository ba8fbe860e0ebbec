"""platform-core's Intel XPU backend: Triton or IPEX paged attention, XCCL collectives."""

__version__ = "0.1.0"
