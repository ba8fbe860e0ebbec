"""The cuda, rocm and xpu backends' Triton kernels pass the conformance kernel checks on the CPU,
under Triton's interpreter with their own launch settings for a faked device
(``platform_core_conformance.interpret``). Each backend runs in a child process (Triton reads
``TRITON_INTERPRET`` at import) on one dtype, so together they cover the three kernel dtypes
while CI stays short; the slowest scenario (``long``) is left to real-GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the GPU backends' kernels are Triton kernels")

KERNELS = "test_write_kv or test_padding or test_paged_attention or test_gqa_ratios"
CHECKS = f"({KERNELS} or quantized_linear or apply_token_bitmask or lora_) and not long"


@pytest.mark.parametrize(
    ("backend", "dtype"), [("cuda", "bfloat16"), ("rocm", "float16"), ("xpu", "float32")]
)
def test_gpu_kernels_pass_under_the_triton_interpreter(
    backend: str, dtype: str, tmp_path: Path
) -> None:
    report = tmp_path / f"{backend}.json"
    argv = [sys.executable, "-m", "platform_core_conformance.interpret", backend]
    argv += ["--report", str(report), "-k", f"({CHECKS}) and {dtype}"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    doc = json.loads(report.read_text())
    assert doc["backend"] == f"{backend}-interpreted"
    assert doc["backend_package"] == f"platform-core-{backend}"
    names = [c["id"].split("::")[-1] for c in doc["checks"]]
    assert doc["summary"]["passed"] == len(names) >= 12
    assert all(dtype in name for name in names)
    assert "test_gqa_ratios[" + dtype + "-gqa8-kv2]" in names
    quantized = [name for name in names if "quantized_linear" in name]
    assert len(quantized) >= 12 and any("Q4_1" in name for name in quantized), quantized
    assert any("FP8_E4M3" in name for name in quantized), quantized
    lora = [name for name in names if "lora_" in name]
    assert {name.split("-")[1] for name in lora} == {"lora_shrink", "lora_expand"}, lora


def test_the_interpreter_must_be_on(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, "-m", "platform_core_conformance.interpret", "cuda"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "set TRITON_INTERPRET=1" in done.stderr
