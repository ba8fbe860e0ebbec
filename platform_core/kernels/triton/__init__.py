"""Triton paged-attention kernels shared by the GPU backends (cuda, rocm, xpu).

Importing this package does not import triton; the submodules do, so the core runs without it.
Layout of one layer's KV cache: the canonical ``[2, num_blocks, block_size, num_kv_heads,
head_size]`` of :mod:`platform_core.attention.reference` (kernels read strides, so a backend may
pass any layout with the same four logical axes).

- :mod:`.launch`: tile sizes and the split-KV decision for one launch (pure Python).
- :mod:`.write_kv`: scatter new keys/values into the cache through the slot mapping.
- :mod:`.paged_attention`: attention over a flattened mixed batch, with a split-KV path.
- :mod:`.ops`: the kernels behind :class:`~platform_core.plugins.interfaces.AttentionOps`.

The kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (set before import), which is how
CPU CI tests them.
"""

from __future__ import annotations

import importlib.util
import os

from platform_core.plugins.identity import installed_version
from platform_core.plugins.interfaces import Capabilities

# What the shared kernels are tested for; GPU backends declare these unless they narrow them.
KERNEL_CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16", "float32"),
    head_sizes=(64, 96, 128, 256),
    block_sizes=(16, 32, 64),
    features=("prefix_caching", "chunked_prefill"),
)


def triton_installed() -> bool:
    """Whether the ``triton`` module can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_version(*distributions: str) -> str | None:
    """The installed version of Triton, from the first of ``distributions`` (the builds name
    it differently) found installed, or ``None`` when ``triton`` cannot be imported."""
    return installed_version(*distributions) if triton_installed() else None


def triton_interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
