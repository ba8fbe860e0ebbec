"""Prerequisite checks run first; the checks that build on them skip when one failed.

A check marked ``@pytest.mark.prerequisite("write_kv")`` provides ``write_kv`` for its dtype; one
marked ``@pytest.mark.requires("write_kv", ...)`` (or in a module whose ``pytestmark`` says so)
is skipped, naming the failed prerequisite, when a check providing it failed for the same dtype
(for any dtype, if the dependent has none). A wrong ``write_kv`` then shows as one failure, not
as twenty collateral ones. Prerequisites not selected in a run (``-k``) do not gate anything.
"""

from __future__ import annotations

import pytest

FAILED_KEY = pytest.StashKey[dict[tuple[str, str | None], str]]()


def _dtype(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("dtype") if callspec is not None else None


def _provided(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("prerequisite")
    return marker.args[0] if marker is not None else None


def order_prerequisites_first(items: list[pytest.Item]) -> None:
    """Move prerequisite checks to the front, keeping the order within each group."""
    items.sort(key=lambda item: _provided(item) is None)


def record_failure(item: pytest.Item, report: pytest.TestReport) -> None:
    """Remember a failed prerequisite check (any phase) under ``(name, dtype)``."""
    name = _provided(item)
    if name is not None and report.failed:
        failed = item.session.stash.setdefault(FAILED_KEY, {})
        failed.setdefault((name, _dtype(item)), item.name)


def skip_if_prerequisite_failed(item: pytest.Item) -> None:
    """Skip ``item`` when a prerequisite it requires failed earlier in the run."""
    if _provided(item) is not None:
        return
    failed = item.session.stash.get(FAILED_KEY, {})
    dtype = _dtype(item)
    for marker in item.iter_markers("requires"):
        for name in marker.args:
            culprits = [
                check
                for (provided, check_dtype), check in failed.items()
                if provided == name and (dtype is None or check_dtype in (dtype, None))
            ]
            if culprits:
                pytest.skip(f"skipped because prerequisite {culprits[0]} ({name}) failed")
