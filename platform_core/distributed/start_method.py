"""Which way to start child processes: fork where that is safe, spawn otherwise.

Fork copies the parent as it is, so a child runs whatever started it without re-running the
user's script: a plain script with no ``if __name__ == "__main__":`` guard works. Fork is *safe*
here when nothing in the parent that the child goes on to use is left half-alive by the copy:

- the platform is Linux (macOS system libraries are not fork-safe; Windows cannot fork);
- no accelerator runtime is initialised: ``torch.cuda`` (CUDA and ROCm), ``torch.xpu`` and any
  other ``torch.<device>`` module with ``is_initialized()`` (a forked child cannot use it);
- this process is not in a ``torch.distributed`` group (its sockets and threads would be shared);
- no other Python thread runs (a lock another thread holds stays held in the child forever);
- GNU OpenMP (libgomp, torch's intra-op pool on Linux) has no thread pool. After a parallel
  region its pool threads persist; a forked child that runs a parallel region with more than one
  thread then waits on them forever. libgomp releases its pool on ``omp_pause_resource_all``
  (OpenMP 5.0), so we ask it to: the parent's next parallel region builds a new pool. LLVM's and
  Intel's OpenMP runtimes reset themselves in a forked child and need nothing.

Spawn starts a fresh interpreter that re-imports the main module; a script that starts the
engine from its top level outside the guard would start it again in every child, so that case
fails at once with :class:`UnguardedMainError` (see :func:`check_main_survives_spawn`).
"""

from __future__ import annotations

import ast
import ctypes
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from platform_core.config import WORKER_START_METHODS
from platform_core.errors import ConfigError, UnguardedMainError

START_METHOD_ENV = "PLATFORM_CORE_WORKER_START"
_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2

logger = logging.getLogger("platform_core.distributed")


@dataclass(frozen=True, slots=True)
class StartMethod:
    """How new child processes start (``"fork"`` or ``"spawn"``) and why that way."""

    name: str
    reason: str


def choose_start_method(requested: str = "auto") -> StartMethod:
    """The start method for children started now.

    ``requested`` is ``"fork"``, ``"spawn"`` or ``"auto"``; ``"auto"`` takes
    ``$PLATFORM_CORE_WORKER_START`` when it is set, else forks when :func:`fork_hazards` finds
    none. A forced fork despite hazards is logged as a warning with them.
    """
    source = "requested"
    if requested == "auto" and os.environ.get(START_METHOD_ENV):
        requested, source = os.environ[START_METHOD_ENV], f"${START_METHOD_ENV}"
    if requested not in WORKER_START_METHODS:
        raise ConfigError(
            f"worker start method must be one of {WORKER_START_METHODS}, got {requested!r} "
            f"({source})"
        )
    if requested == "spawn":
        return StartMethod("spawn", f"spawn {source}")
    hazards = fork_hazards()
    if requested == "fork":
        if hazards:
            logger.warning("forking as %s, although %s", source, "; ".join(hazards))
        return StartMethod("fork", f"fork {source}")
    if hazards:
        return StartMethod("spawn", "fork is unsafe here: " + "; ".join(hazards))
    return StartMethod("fork", "fork is safe here")


def fork_hazards() -> list[str]:
    """Why forking this process now could break the child (empty: it is safe; see the module
    docstring). Releases libgomp's idle thread pool on the way."""
    if not sys.platform.startswith("linux"):
        return [f"fork is used only on Linux (this is {sys.platform})"]
    hazards = [f"torch.{name} is initialised" for name in _initialised_torch_runtimes()]
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        hazards.append("this process is in a torch.distributed process group")
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
    if others:
        hazards.append(f"other threads are running ({', '.join(others)})")
    hazards += [f"OpenMP runtime {path} kept its thread pool" for path in release_openmp_pools()]
    return hazards


def _initialised_torch_runtimes() -> list[str]:
    """Names of the ``torch.<device>`` modules whose runtime this process has initialised."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    found = []
    for name in ("cuda", "xpu", "mtia"):
        is_initialized = getattr(getattr(torch, name, None), "is_initialized", None)
        if is_initialized is not None and is_initialized():
            found.append(name)
    return found


def release_openmp_pools() -> list[str]:
    """Ask every loaded libgomp to free its thread pool; the paths of those that could not."""
    failed = []
    for path in _loaded_libgomps():
        try:
            library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            if library.omp_pause_resource_all(_OMP_PAUSE_HARD) != 0:
                failed.append(path)
        except (OSError, AttributeError):  # not loadable, or older than OpenMP 5.0
            failed.append(path)
    return failed


def _loaded_libgomps() -> set[str]:
    """Paths of the GNU OpenMP libraries mapped into this process (wheels vendor renamed ones)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    paths = (line.split(maxsplit=5)[-1] for line in maps.splitlines() if "/libgomp" in line)
    return {path for path in paths if Path(path).name.startswith("libgomp")}


def check_main_survives_spawn(reason: str) -> None:
    """Raise :class:`UnguardedMainError` if a spawned child would re-run the code starting it:
    this call comes from the main script's top level, outside ``if __name__ == "__main__":``.
    ``reason`` says why children are spawned (it goes into the error)."""
    script = _script_spawn_reruns()
    if script is None:
        return
    line = _top_level_line_of_main()
    if line is None or _under_main_guard(script, line):
        return
    raise UnguardedMainError(
        f"{script}, line {line}, starts platform-core's worker processes from the script's top "
        f"level. They are spawned here ({reason}), and spawning runs the script again in every "
        "new process. Put the code that starts the engine under "
        f"'if __name__ == \"__main__\":', or, where forking is safe, set "
        f"{START_METHOD_ENV}=fork (or worker_start_method='fork')."
    )


def _script_spawn_reruns() -> str | None:
    """The file a spawned child runs as ``__mp_main__`` (multiprocessing's own rule: a main
    module run with ``-m`` is re-imported by name unless it is a package's ``__main__``)."""
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return None
    return getattr(main, "__file__", None)


def _top_level_line_of_main() -> int | None:
    """The line the main module's top-level code is running now, if this call comes from it."""
    main_globals = getattr(sys.modules.get("__main__"), "__dict__", None)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is main_globals and frame.f_code.co_name == "<module>":
            return frame.f_lineno
        frame = frame.f_back
    return None


def _under_main_guard(script: str, line: int) -> bool:
    """Whether ``line`` of ``script`` lies in the body of an ``if __name__ == "__main__":``
    (an unreadable script counts as guarded: nothing is known against it)."""
    try:
        tree = ast.parse(Path(script).read_text(), script)
    except (OSError, SyntaxError, ValueError):
        return True
    return any(
        node.body[0].lineno <= line <= (node.body[-1].end_lineno or line)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_main_test(node.test)
    )


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    constants = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and constants == ["__main__"]
