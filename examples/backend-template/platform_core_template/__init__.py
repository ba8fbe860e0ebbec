"""A minimal platform-core backend for vendors to copy (reference attention, host memory)."""

__version__ = "0.1.0"
