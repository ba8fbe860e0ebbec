"""Host-memory profiling for the CPU backend, from /proc (Linux) with a portable fallback."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from platform_core.backend_api import MemoryProfiler, MemoryReport

DEFAULT_KV_CACHE_SPACE = 4 << 30
KV_CACHE_SPACE_ENV = "PLATFORM_CORE_CPU_KV_CACHE_SPACE"


def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes; empty when unavailable."""
    path = Path("/proc/meminfo")
    if not path.exists():
        return {}
    info = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            info[key] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    return info


def _status_bytes(field: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) for this process; False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class CpuMemoryProfiler(MemoryProfiler):
    """Reports host memory; the peak is the rise of resident memory over a dummy forward.

    The KV budget defaults to at most 4 GiB (``PLATFORM_CORE_CPU_KV_CACHE_SPACE`` in bytes
    changes it): host memory is shared with everything else on the machine.
    """

    def profile(self, run_dummy_forward: Callable[[], None], weights_bytes: int) -> MemoryReport:
        info = _meminfo()
        total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        available = info.get("MemAvailable", total)
        before = _status_bytes("VmRSS") or 0
        can_track_peak = _reset_peak_rss()
        run_dummy_forward()
        peak = _status_bytes("VmHWM") if can_track_peak else _status_bytes("VmRSS")
        return MemoryReport(
            device="cpu",
            total_bytes=total,
            available_bytes=available,
            weights_bytes=weights_bytes,
            peak_bytes=max(0, (peak or before) - before),
        )

    def kv_cache_budget(self, report: MemoryReport, utilization: float) -> int:
        cap = int(os.environ.get(KV_CACHE_SPACE_ENV, DEFAULT_KV_CACHE_SPACE))
        return min(cap, report.kv_budget_bytes(utilization))
