"""Memory profiling over a torch caching allocator, shared by the accelerator backends.

The backend passes its device module (the CUDA one on NVIDIA and ROCm, the XPU one on Intel);
this module never imports one, so the core stays device-free. Nothing here is a kernel; it lives
beside the shared kernels because the GPU backends are separate distributions with no other
common home.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from platform_core.plugins.interfaces import MemoryProfiler, MemoryReport


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
