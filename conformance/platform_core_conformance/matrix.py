"""A support matrix from one or more JSON conformance reports: markdown and a self-contained HTML
page, one row per backend and dtype, so a vendor publishes what passed.

A cell is ``pass`` when every check of that row and column passed, ``FAIL`` when one failed or
errored, ``skip`` when all were skipped and ``-`` when none ran. Columns: the kernel, op and KV
block checks, each declared head size and block size, and each end-to-end feature.

Run ``python -m platform_core_conformance.matrix a.json b.json --markdown m.md --html m.html``.
"""

from __future__ import annotations

import argparse
import html
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# End-to-end feature -> the check whose outcomes decide it.
FEATURES = {
    "greedy": "test_greedy_matches_hf",
    "prefix caching": "test_prefix_caching",
    "chunked prefill": "test_chunked_prefill",
    "preemption": "test_preemption",
    "n > 1": "test_n_completions",
    "speculative": "test_ngram_speculative",
}
_PARAMS = re.compile(r"\[(.*)\]$")


@dataclass(frozen=True, slots=True)
class Check:
    """One check of a report: its function name, parameters and outcome."""

    function: str
    params: tuple[str, ...]
    outcome: str

    @classmethod
    def parse(cls, entry: dict[str, Any]) -> Check:
        name = entry["id"].split("::")[-1]
        match = _PARAMS.search(name)
        params = tuple(match.group(1).split("-")) if match else ()
        return cls(name.split("[")[0], params, entry["outcome"])


def cell(outcomes: Iterable[str]) -> str:
    """The summary of several outcomes (see the module docstring)."""
    seen = set(outcomes)
    if not seen:
        return "-"
    if seen & {"failed", "error"}:
        return "FAIL"
    return "skip" if seen == {"skipped"} else "pass"


@dataclass(frozen=True, slots=True)
class Row:
    """One backend and dtype of the matrix: identity and one cell per column."""

    backend: str
    version: str
    device: str
    platform_core: str
    dtype: str
    cells: dict[str, str]


def _outcomes(checks: Iterable[Check], prefix: str, param: str | None = None) -> list[str]:
    return [
        c.outcome
        for c in checks
        if c.function.startswith(prefix) and (param is None or param in c.params)
    ]


def rows_of(report: dict[str, Any]) -> list[Row]:
    """The matrix rows of one report, one per declared dtype."""
    checks = [Check.parse(entry) for entry in report.get("checks", [])]
    caps = report.get("capabilities", {})
    rows = []
    for dtype in caps.get("dtypes", []):
        mine = [c for c in checks if dtype in c.params]
        kernels = _outcomes(mine, "test_paged_attention") + _outcomes(mine, "test_gqa")
        cells = {"kernels": cell(kernels), "ops": cell(_outcomes(mine, "test_op_override"))}
        cells["kv blocks"] = cell(_outcomes(mine, "test_kv_block"))
        for h in caps.get("head_sizes", []):
            cells[f"h{h}"] = cell(_outcomes(mine, "test_every_head_size", f"h{h}"))
        for b in caps.get("block_sizes", []):
            cells[f"b{b}"] = cell(_outcomes(mine, "test_every_block_size", f"b{b}"))
        for feature, prefix in FEATURES.items():
            cells[feature] = cell(_outcomes(mine, prefix))
        rows.append(
            Row(
                report.get("backend", "?"),
                report.get("backend_version", "?"),
                report.get("device", "?"),
                report.get("platform_core_version", "?"),
                dtype,
                cells,
            )
        )
    return rows


def _columns(rows: Sequence[Row]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [name for name in row.cells if name not in columns]
    return columns


def _table(rows: Sequence[Row]) -> tuple[list[str], list[list[str]]]:
    columns = _columns(rows)
    header = ["backend", "version", "device", "platform-core", "dtype", *columns]
    body = [
        [r.backend, r.version, r.device, r.platform_core, r.dtype]
        + [r.cells.get(name, "-") for name in columns]
        for r in rows
    ]
    return header, body


def to_markdown(rows: Sequence[Row]) -> str:
    """The matrix as a markdown table."""
    header, body = _table(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(values) + " |" for values in body]
    return "\n".join(lines) + "\n"


_STYLE = (
    "body{font-family:sans-serif}table{border-collapse:collapse}"
    "td,th{border:1px solid #999;padding:2px 6px;text-align:center}"
    ".pass{background:#cfc}.FAIL{background:#f99}.skip{background:#eee}"
)


def to_html(rows: Sequence[Row], title: str = "platform-core support matrix") -> str:
    """The matrix as one self-contained HTML page (inline style, no scripts or links)."""
    header, body = _table(rows)
    head = "".join(f"<th>{html.escape(name)}</th>" for name in header)
    lines = [
        "".join(f'<td class="{html.escape(v)}">{html.escape(v)}</td>' for v in values)
        for values in body
    ]
    rows_html = "".join(f"<tr>{line}</tr>" for line in lines)
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<table><tr>{head}</tr>{rows_html}</table></body></html>\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: reports in, markdown and/or HTML out (markdown to stdout by default)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="JSON conformance reports")
    parser.add_argument("--markdown", type=Path, help="write the markdown table here")
    parser.add_argument("--html", type=Path, help="write the HTML page here")
    args = parser.parse_args(argv)
    rows = [row for path in args.reports for row in rows_of(json.loads(path.read_text()))]
    if args.markdown is None and args.html is None:
        print(to_markdown(rows), end="")
    if args.markdown is not None:
        args.markdown.write_text(to_markdown(rows))
    if args.html is not None:
        args.html.write_text(to_html(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
