"""Which instruction sets this CPU has, and which kernel build (ISA level) the backend runs.

The compiled kernels are built once per ISA level, each with that level's compiler flags, so a
build runs on every CPU that has the level's features. Levels, lowest first (each includes the
ones before it):

- ``generic``: the compiler's baseline for the machine (any x86-64 or Arm CPU);
- ``avx2``: AVX2 and FMA (x86-64-v3: Haswell, Zen 1 and later);
- ``avx512``: AVX-512 F/BW/CD/DQ/VL (x86-64-v4: Skylake-X, Zen 4);
- ``avx512_bf16``: AVX-512 plus AVX512-BF16 dot products and AVX512-VNNI integer dot products
  (Cooper Lake, Sapphire Rapids, Zen 4: every CPU with the first has the second; the quantized
  linears use VNNI).

The backend runs the highest level the CPU has, unless ``PLATFORM_CORE_CPU_ISA`` names a lower
one: the way a CPU with AVX-512 runs (and tests) the AVX2 path. Forcing a level also makes the
backend behave as a CPU of that level for the other paths (oneDNN's bf16 linears, the ``auto``
dtype), so a forced run is what a user of that CPU gets. AMX is reported but needs no build of
ours: oneDNN uses it for bf16 linears where the CPU has it.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from platform_core.backend_api import ConfigError

ISA_ENV = "PLATFORM_CORE_CPU_ISA"
ISA_LEVELS = ("generic", "avx2", "avx512", "avx512_bf16")

# /proc/cpuinfo flags each level needs, beyond those of the levels below it.
_LEVEL_FLAGS: dict[str, tuple[str, ...]] = {
    "generic": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
    "avx512_bf16": ("avx512_bf16", "avx512_vnni"),
}

# Compiler flags of each level's build (GCC 11+ / Clang 12+ know the x86-64-v* names). Tuning
# for the host changes no instruction the build may use.
LEVEL_CFLAGS: dict[str, tuple[str, ...]] = {
    "generic": (),
    "avx2": ("-march=x86-64-v3", "-mtune=native"),
    "avx512": ("-march=x86-64-v4", "-mtune=native", "-mprefer-vector-width=512"),
    "avx512_bf16": (
        "-march=x86-64-v4",
        "-mavx512bf16",
        "-mavx512vnni",
        "-mtune=native",
        "-mprefer-vector-width=512",
    ),
}

_REPORTED_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_bf16",
    "avx_ne_convert",
)


@dataclass(frozen=True, slots=True)
class CpuIsa:
    """The host CPU's relevant features and the kernel level the backend runs.

    Attributes:
        flags: the CPU's feature flags (``/proc/cpuinfo``'s names).
        supported: every level this CPU can run, lowest first.
        level: the level in use (the highest supported, or the one ``PLATFORM_CORE_CPU_ISA``
            names).
        forced: whether ``level`` was forced below the CPU's highest.
    """

    flags: frozenset[str]
    supported: tuple[str, ...]
    level: str
    forced: bool

    def at_least(self, level: str) -> bool:
        """Whether the level in use includes ``level``."""
        return ISA_LEVELS.index(self.level) >= ISA_LEVELS.index(level)

    @property
    def native_bf16(self) -> bool:
        """bf16 arithmetic in hardware: AVX512-BF16 at the level in use, or AMX (unless forced
        to a lower level, which stands for a CPU without it)."""
        return self.at_least("avx512_bf16") or ("amx_bf16" in self.flags and not self.forced)

    @property
    def onednn_bf16(self) -> bool:
        """Whether oneDNN computes bf16 linears here: it needs AVX-512 (BW, VL, DQ) or
        AVX-NE-CONVERT, and refuses other CPUs with an error."""
        if self.forced:
            return self.at_least("avx512")
        return self.at_least("avx512") or "avx_ne_convert" in self.flags

    def describe(self) -> str:
        """One line for logs and ``platform-core backends``."""
        shown = [flag for flag in _REPORTED_FLAGS if flag in self.flags] or ["none of note"]
        forced = f", forced by {ISA_ENV}" if self.forced else ""
        return f"kernels {self.level}{forced} (CPU: {' '.join(shown)})"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def supported_levels(flags: frozenset[str], machine: str | None = None) -> tuple[str, ...]:
    """The levels a CPU with ``flags`` runs, lowest first; x86-64 only beyond ``generic``."""
    machine = machine or platform.machine()
    levels = ["generic"]
    if machine not in ("x86_64", "AMD64"):
        return tuple(levels)
    for level in ISA_LEVELS[1:]:
        if not all(flag in flags for flag in _LEVEL_FLAGS[level]):
            break
        levels.append(level)
    return tuple(levels)


def resolve_isa(flags: frozenset[str], requested: str | None, machine: str | None = None) -> CpuIsa:
    """The level to run: ``requested`` (a forced level) or the highest the CPU supports.

    Raises:
        ConfigError: ``requested`` is no level, or one this CPU cannot run.
    """
    supported = supported_levels(flags, machine)
    if not requested:
        return CpuIsa(flags, supported, supported[-1], forced=False)
    if requested not in ISA_LEVELS:
        raise ConfigError(f"{ISA_ENV}={requested!r} is not a level; valid: {ISA_LEVELS}")
    if requested not in supported:
        raise ConfigError(
            f"{ISA_ENV}={requested!r}: this CPU runs only {supported} (it lacks "
            f"{[f for f in _LEVEL_FLAGS[requested] if f not in flags] or 'x86-64'})"
        )
    return CpuIsa(flags, supported, requested, forced=requested != supported[-1])


@functools.cache
def _host_isa(requested: str | None) -> CpuIsa:
    return resolve_isa(cpu_flags(), requested)


def host_isa() -> CpuIsa:
    """This CPU's :class:`CpuIsa`, at the level ``PLATFORM_CORE_CPU_ISA`` forces if set."""
    return _host_isa(os.environ.get(ISA_ENV) or None)
