"""Child processes that do not outlive their parent: ``die_with_parent``.

On Linux the kernel can send a signal to a process when its parent goes (``PR_SET_PDEATHSIG``).
The signal follows the parent *thread* that started the child, not the whole parent process, so
a parent must start such children from a thread that lives as long as they should (the engine
core's main thread for tensor-parallel workers; ``ProcessEngine``'s own receiving thread for the
engine core). Elsewhere this is a no-op and the children rely on their other checks.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> None:
    """Have this process get ``signum`` when its parent thread exits; exit at once if the
    parent (``parent_pid``) is already gone (it went before the request was made)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)
