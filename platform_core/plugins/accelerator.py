"""What the GPU-like backends (cuda, rocm, xpu) share: a backend skeleton over a torch device
module, memory profiling through its caching allocator, and the parts of their probes.

A backend passes its device module (``torch.cuda`` on NVIDIA and ROCm, ``torch.xpu`` on Intel);
this module never imports one, so the core stays device-free. The backends are separate
distributions that must not import each other, so their common code lives here, in the core's
backend API.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from platform_core.errors import BackendError
from platform_core.plugins.interfaces import (
    Backend,
    BackendInfo,
    MemoryProfiler,
    MemoryReport,
)


class CachingAllocatorProfiler(MemoryProfiler):
    """Profiles ``device`` through ``device_module``'s allocator statistics.

    Free and total memory come from ``mem_get_info`` after the dummy forward with the cache
    emptied (so memory others took, or the runtime grew into during the forward, counts as
    used); the peak is what the allocator held at most above its level before the forward.
    """

    def __init__(self, device_module: Any, device: torch.device) -> None:
        self.module = device_module
        self.device = device

    def profile(self, run_dummy_forward: Callable[[], None], weights_bytes: int) -> MemoryReport:
        module, device = self.module, self.device
        module.synchronize(device)
        module.empty_cache()
        baseline = module.memory_allocated(device)
        module.reset_peak_memory_stats(device)
        run_dummy_forward()
        module.synchronize(device)
        peak = module.max_memory_allocated(device) - baseline
        module.empty_cache()
        free, total = module.mem_get_info(device)
        return MemoryReport(
            device=str(device),
            total_bytes=int(total),
            available_bytes=int(free),
            weights_bytes=weights_bytes,
            peak_bytes=max(0, int(peak)),
        )


class AcceleratorBackend(Backend):
    """A backend on device ``<device_type>:$LOCAL_RANK`` (0 when unset) of ``device_module``.

    Makes the device current, keeps its properties (``properties``, for launch settings and
    capabilities), profiles memory through the module's caching allocator and synchronizes
    through the module. A subclass sets ``capabilities`` and ``attention`` after calling this
    constructor, ``process_group_backend``, and ``layer_ops`` (its op overrides, e.g. the shared
    Triton kernels' ``triton_op_overrides()``).
    """

    layer_ops: dict[str, Any] = {}  # noqa: RUF012 - replaced, never mutated

    def __init__(self, name: str, device_type: str, device_module: Any) -> None:
        self.name = name
        self.device_module = device_module
        self.device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0")))
        device_module.set_device(self.device)
        self.properties = device_module.get_device_properties(self.device)
        self.memory = CachingAllocatorProfiler(device_module, self.device)

    def synchronize(self) -> None:
        self.device_module.synchronize(self.device)

    def op_overrides(self) -> dict[str, Any]:
        """The subclass's ``layer_ops``."""
        return dict(self.layer_ops)


def count_devices(device_module: Any, runtime: str) -> tuple[int, str | None]:
    """``device_module.device_count()``, and the problem when counting initialised ``runtime``
    in this (probing) process, which a probe must not do."""
    count = device_module.device_count()
    if device_module.is_initialized():
        name = getattr(device_module, "__name__", "device module")
        return count, f"{name}.device_count() initialised {runtime} in the probing process"
    return count, None


def gpu_device_text(device_type: str, count: int, model: str = "") -> str:
    """The device column of a GPU backend's row: ``"cuda (2 x NVIDIA A100)"``,
    ``"rocm (8 GPU(s))"`` or ``"xpu (no GPU)"``."""
    if count == 0:
        return f"{device_type} (no GPU)"
    return f"{device_type} ({count} x {model})" if model else f"{device_type} ({count} GPU(s))"


def require_available(info: BackendInfo) -> None:
    """Raise ``BackendError`` with the probe's reason when ``info`` is not available (a create
    hook called directly, without the plugin manager's choice)."""
    if not info.available:
        raise BackendError(f"backend {info.name!r} is not available: {info.reason}")
