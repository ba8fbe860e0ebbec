"""platform-core's CPU backend: paged attention, memory profiling and gloo collectives."""

__version__ = "0.1.0"
