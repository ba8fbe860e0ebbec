"""OpenMP settings platform-core starts with, set before torch loads its OpenMP runtime.

libgomp (torch's OpenMP on Linux) lets a thread that finished its share of a parallel region
spin for ``GOMP_SPINCOUNT`` iterations (300,000 by default) before it sleeps. On a machine
whose cores are all ours that saves a wake-up between back-to-back kernels; on a shared one
(another process on a core) the spinning threads take time slices from the thread everyone
waits for, and throughput collapses. 10,000 iterations keep the quiet-machine speed (within
3%) and a quarter more under contention; fewer trade more quiet speed for it (3,000: -18% quiet,
+45% under contention; benchmarks/RESULTS.md: the mixed workload beside ``stress-ng --cpu 1``).
A value the user set is kept; libgomp reads it once, so this works only where platform-core is
imported before torch (the CLI, the server, a script that imports it first).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEFAULTS = {"GOMP_SPINCOUNT": "10000"}
_filled_in_process: set[str] = set()


def apply_openmp_defaults(environ: MutableMapping[str, str] | None = None) -> None:
    """Fill in :data:`DEFAULTS` for variables ``environ`` (default: ``os.environ``) leaves
    unset."""
    target = os.environ if environ is None else environ
    for name, value in DEFAULTS.items():
        if name not in target:
            target[name] = value
            if environ is None:
                _filled_in_process.add(name)


def environ_without_defaults() -> dict[str, str]:
    """``os.environ`` less what :func:`apply_openmp_defaults` filled in: the environment another
    engine run side by side gets, as the user's shell set it."""
    return {k: v for k, v in os.environ.items() if k not in _filled_in_process}
