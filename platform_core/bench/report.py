"""Printing benchmark results and saving them as JSON with the machine they ran on."""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def cpu_flags() -> list[str]:
    """Which of :data:`CPU_FLAGS` ``/proc/cpuinfo`` lists (empty where it does not exist)."""
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return [flag for flag in CPU_FLAGS if flag in words]


def machine_info() -> dict[str, Any]:
    """CPU count and flags, torch threads, load average and versions: context for every
    number."""
    import torch

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15": load,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def save_result(path: str | Path, kind: str, settings: Mapping[str, Any], result: Any) -> None:
    """Write ``{"benchmark", "settings", "machine", "result"}`` as indented JSON."""
    payload = {
        "benchmark": kind,
        "settings": dict(settings),
        "machine": machine_info(),
        "result": result,
    }
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def format_value(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:.1f}"
    return str(value)


def print_rows(title: str, rows: list[tuple[str, Any]]) -> None:
    """A titled block of ``label: value`` lines, labels aligned."""
    width = max(len(label) for label, _ in rows)
    print(f"==== {title} ====")
    for label, value in rows:
        print(f"{label + ':':<{width + 2}}{format_value(value)}")


def stat_rows(name: str, stats: Mapping[str, float | None], unit: str) -> list[tuple[str, Any]]:
    """Rows ``Mean NAME (unit)``, ``Median NAME``, ``P99 NAME`` ... from a ``summarize`` dict."""
    return [(f"{key.capitalize()} {name} ({unit})", value) for key, value in stats.items()]
