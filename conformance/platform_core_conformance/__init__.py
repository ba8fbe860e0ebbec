"""The platform-core conformance suite: the checks every backend must pass, and their reports.

Run it with ``platform-core conformance --backend NAME`` (see :func:`run_conformance`) or with
``pytest --backend NAME``; the pytest plugin of this package adds the option.
"""

from __future__ import annotations

from platform_core_conformance.runner import run_conformance

__version__ = "0.1.0"

__all__ = ["__version__", "run_conformance"]
