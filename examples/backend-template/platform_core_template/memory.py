"""Memory profiling of the template: this process's resident host memory (Linux ``/proc``).

A device backend replaces this with its allocator's statistics: reset the peak counter, run the
dummy forward, report the peak minus what was allocated before, and the device's total and free
bytes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from platform_core.backend_api import MemoryProfiler, MemoryReport

SAMPLE_INTERVAL_S = 0.001


def resident_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def host_memory() -> tuple[int, int]:
    """Total and currently free physical memory of the host, in bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page


class HostMemoryProfiler(MemoryProfiler):
    """The peak is the highest resident size sampled (every ``SAMPLE_INTERVAL_S``) while the
    dummy forward runs, above the resident size before it."""

    def profile(self, run_dummy_forward: Callable[[], None], weights_bytes: int) -> MemoryReport:
        total, available = host_memory()
        before = resident_bytes()
        peak = before
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.wait(SAMPLE_INTERVAL_S):
                peak = max(peak, resident_bytes())

        sampler = threading.Thread(target=sample, name="memory-sampler", daemon=True)
        sampler.start()
        try:
            run_dummy_forward()
        finally:
            done.set()
            sampler.join()
        return MemoryReport(
            device="cpu",
            total_bytes=total,
            available_bytes=available,
            weights_bytes=weights_bytes,
            peak_bytes=max(0, peak - before),
        )
