"""Builds and loads the compiled CPU kernels (attention and fused layer ops) on first use.

The C++ sources in ``csrc/`` are compiled with ``torch.utils.cpp_extension``, once per ISA level
(:mod:`platform_core_cpu.isa`) with that level's flags, into a build folder under
``$PLATFORM_CORE_CACHE/kernels`` (default ``~/.cache/platform-core/kernels``) named by a hash of
the sources, the flags, this module, the torch version and the host CPU, so a build is reused by
every later process and a changed source or machine gets a fresh one. A build is reused only
when its library still has the sha256 recorded when it last loaded; an interrupted build (no
record) or a damaged library is discarded and compiled again (:func:`build_problem`). Each level
registers its ops in its own namespace, ``torch.ops.platform_core_cpu_<level>.{paged_attention,
write_kv, rms_norm, silu_and_mul, rotary, linear_bf16, quantized_linear, argmax_rows,
apply_token_bitmask, lora_shrink, lora_expand}``, so one process can load several levels (the
tests check every level the CPU runs against the reference).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
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
    "quantized_linear.cpp",
    "argmax.cpp",
    "token_bitmask.cpp",
    "lora.cpp",
    "ops.cpp",
)
HEADERS = (
    "cpu_kernels.h",
    "vec_math.h",
    "quant_simd.h",
    "quant_formats.h",
    "bf16_panel_gemm.h",
)
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)
_LOCK_NAME = ".platform-core-build.lock"
# sha256 of the library as it last loaded: a build without it never finished (or predates it).
_LOADED_NAME = ".platform-core-loaded.sha256"


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
    with (build_dir / _LOCK_NAME).open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building the CPU kernels in %s", build_dir)
            fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing a stale build lock left by a killed build: %s", stale)
            stale.unlink(missing_ok=True)
        yield


def build_problem(build_dir: Path, library: Path) -> str | None:
    """Why the build in ``build_dir`` cannot be reused as it is, or None.

    A build is reusable when ``library`` still has the sha256 recorded after it last loaded
    (a few ms for a few MB). Anything else (no record: an interrupted build, whose objects or
    ``build.ninja`` may be half-written; a changed or truncated library) is built from scratch.
    """
    try:
        recorded = (build_dir / _LOADED_NAME).read_text().strip()
    except OSError:
        return "no build finished there"
    if not library.is_file():
        return f"{library.name} is missing"
    if recorded != _sha256(library):
        return f"{library.name} changed since it last loaded"
    return None


@functools.cache
def load_kernels(level: str) -> KernelBuild:
    """Build (when no verified build matches) and load the kernels of ISA ``level`` once per
    process.

    Never raises: a failed build is reported through ``KernelBuild.reason`` so the caller can
    fall back to pure torch; the failure is remembered for the rest of the process.
    """
    start = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        name = f"platform_core_cpu_{level}_{build_key(level)}"
        build_dir = cache_dir() / name
        library = build_dir / f"{name}.so"
        build_dir.mkdir(parents=True, exist_ok=True)
        with build_lock(build_dir):
            problem = build_problem(build_dir, library)
            if problem is not None:
                if _clear(build_dir):
                    logger.warning("discarded the build in %s: %s", build_dir, problem)
                logger.info(
                    "compiling the CPU kernels (%s) once (about a minute), into %s",
                    level,
                    build_dir,
                )
            cpp_extension.load(
                name=name,
                sources=[str(CSRC / source) for source in SOURCES],
                extra_cflags=_cflags(level),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(build_dir),
                is_python_module=False,
            )
            # Recorded even for a reused build: ninja may have relinked it (newer sources).
            (build_dir / _LOADED_NAME).write_text(_sha256(library) + "\n")
    except Exception as exc:  # any build or load failure means "use the fallback"
        lines = str(exc).strip().splitlines() or [""]
        # A build error's first line is the ninja command; the compiler's own error line says why.
        detail = next((line for line in lines[1:] if "error" in line.lower()), lines[0])
        reason = f"{type(exc).__name__}: {detail.strip()[:300]}"
        return KernelBuild(None, reason, time.perf_counter() - start)
    return KernelBuild(getattr(torch.ops, namespace(level)), "", time.perf_counter() - start)


def _clear(build_dir: Path) -> int:
    """Remove every build output, unlinked so that processes which mapped the library keep
    theirs; returns how many entries there were."""
    outputs = [path for path in build_dir.iterdir() if path.name != _LOCK_NAME]
    for path in outputs:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return len(outputs)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
