"""Builds and loads the compiled CPU kernels (attention and fused layer ops) on first use.

The C++ sources in ``csrc/`` are compiled with ``torch.utils.cpp_extension``, once per ISA level
(:mod:`platform_core_cpu.isa`) with that level's flags, into a build folder under
``$PLATFORM_CORE_CACHE/kernels`` (default ``~/.cache/platform-core/kernels``) named by a hash of
the sources, the flags, this module, the torch version and the host CPU, so a build is reused by
every later process and a changed source or machine gets a fresh one. Each level registers its
ops in its own namespace, ``torch.ops.platform_core_cpu_<level>.{paged_attention, write_kv,
rms_norm, silu_and_mul, rotary, linear_bf16, argmax_rows}``, so one process can load several
levels (the tests check every level the CPU runs against the reference).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from platform_core_cpu.isa import LEVEL_CFLAGS

logger = logging.getLogger("platform_core_cpu")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (
    "paged_attention.cpp",
    "write_kv.cpp",
    "layer_ops.cpp",
    "linear.cpp",
    "argmax.cpp",
    "ops.cpp",
)
HEADERS = ("cpu_kernels.h", "vec_math.h")
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """Outcome of loading the compiled kernels: ``ops`` is ``None`` when they are unavailable.

    Attributes:
        ops: the build's ``torch.ops`` namespace, or ``None``.
        reason: why the kernels are unavailable (empty when they loaded).
        seconds: wall time the build/load took in this process.
    """

    ops: Any
    reason: str
    seconds: float


def cache_dir() -> Path:
    """Root folder of compiled kernel builds."""
    root = os.environ.get("PLATFORM_CORE_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "platform-core"
    return base / "kernels"


def _cpu_identity() -> str:
    """Model and feature flags of the host CPU (what ``-mtune=native`` tunes for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in wanted}))


def namespace(level: str) -> str:
    """The ``torch.ops`` namespace the build of ``level`` registers its ops in."""
    return f"platform_core_cpu_{level}"


def _cflags(level: str) -> list[str]:
    return [*CFLAGS, *LEVEL_CFLAGS[level], f"-DPLATFORM_CORE_CPU_NAMESPACE={namespace(level)}"]


def build_key(level: str) -> str:
    """Hash naming one build: sources, flags, this builder, torch/python versions and the CPU.

    This module is hashed too, so processes that build differently (e.g. another release's
    locking) never share a build folder.
    """
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    for part in (*_cflags(level), *LDFLAGS, torch.__version__, sys.version, _cpu_identity()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold ``build_dir`` exclusively for one build or load.

    torch's own lock file (``lock``) outlives a process killed mid-build, and every later build
    in that folder then waits for it forever. The operating system drops a ``flock`` when its
    holder dies, and every platform-core process takes this one first, so a ``lock`` file found
    while holding it is stale and is removed.
    """
    with (build_dir / ".platform-core-build.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing a stale build lock left by a killed build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def load_kernels(level: str) -> KernelBuild:
    """Build (when no cached build matches) and load the kernels of ISA ``level`` once per
    process.

    Never raises: a failed build is reported through ``KernelBuild.reason`` so the caller can
    fall back to pure torch; the failure is remembered for the rest of the process.
    """
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        name = f"platform_core_cpu_{level}_{build_key(level)}"
        build_dir = cache_dir() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        if not (build_dir / f"{name}.so").exists():
            logger.info("compiling the CPU kernels (%s) once, into %s", level, build_dir)
        with build_lock(build_dir):
            cpp_extension.load(
                name=name,
                sources=[str(CSRC / source) for source in SOURCES],
                extra_cflags=_cflags(level),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(build_dir),
                is_python_module=False,
            )
    except Exception as exc:  # any build or load failure means "use the fallback"
        lines = str(exc).strip().splitlines() or [""]
        # A build error's first line is the ninja command; the compiler's own error line says why.
        detail = next((line for line in lines[1:] if "error" in line.lower()), lines[0])
        reason = f"{type(exc).__name__}: {detail.strip()[:300]}"
        return KernelBuild(None, reason, time.perf_counter() - start)
    return KernelBuild(getattr(torch.ops, namespace(level)), "", time.perf_counter() - start)
