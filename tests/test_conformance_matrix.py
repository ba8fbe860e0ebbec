"""The support matrix summarizes reports per backend and dtype, in markdown and HTML."""

from __future__ import annotations

import json
from pathlib import Path

from platform_core_conformance.matrix import main, rows_of, to_html, to_markdown


def _report(backend: str, checks: dict[str, str]) -> dict:
    return {
        "backend": backend,
        "backend_version": "1.2",
        "device": "npu0",
        "platform_core_version": "0.1.0",
        "capabilities": {
            "dtypes": ["float32", "bfloat16"],
            "head_sizes": [64],
            "block_sizes": [16],
        },
        "checks": [{"id": f"suite/m.py::{name}", "outcome": out} for name, out in checks.items()],
    }


REPORT = _report(
    "npu",
    {
        "test_paged_attention[float32-decode]": "passed",
        "test_paged_attention[bfloat16-decode]": "failed",
        "test_every_head_size[float32-h64]": "passed",
        "test_every_block_size[bfloat16-b16]": "skipped",
        "test_prefix_caching_hits_and_keeps_tokens[float32-llama]": "passed",
        "test_prefix_caching_hits_and_keeps_tokens[float32-qwen2]": "error",
    },
)


def test_cells_summarize_the_checks_of_each_dtype() -> None:
    f32, bf16 = rows_of(REPORT)
    assert (f32.dtype, f32.device, f32.version) == ("float32", "npu0", "1.2")
    assert f32.cells["kernels"] == "pass" and bf16.cells["kernels"] == "FAIL"
    assert (f32.cells["h64"], bf16.cells["h64"]) == ("pass", "-")
    assert bf16.cells["b16"] == "skip"
    assert f32.cells["prefix caching"] == "FAIL"  # one of its checks errored


def test_markdown_and_html_carry_every_row(tmp_path: Path) -> None:
    other = _report("gpu", {"test_paged_attention[float32-decode]": "passed"})
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, report in zip(paths, [REPORT, other]):
        path.write_text(json.dumps(report))
    md, page = tmp_path / "m.md", tmp_path / "m.html"
    assert main([*map(str, paths), "--markdown", str(md), "--html", str(page)]) == 0
    lines = md.read_text().splitlines()
    assert len(lines) == 2 + 4 and lines[2].startswith("| npu | 1.2 | npu0 | 0.1.0 | float32 |")
    assert md.read_text() == to_markdown(rows_of(REPORT) + rows_of(other))
    text = page.read_text()
    assert text == to_html(rows_of(REPORT) + rows_of(other))
    assert text.count("<tr>") == 5 and '<td class="FAIL">FAIL</td>' in text
    assert "<script" not in text and "http" not in text  # self-contained
