"""``platform-core generate`` as a real process on the tiny chat model: what it prints, its
default length, its exit status when a request fails, and its line before kernels compile."""

from __future__ import annotations

import os
import subprocess
import sys

from platform_core.entrypoints.llm import LLM
from platform_core.sampling_params import SamplingParams

FLAGS = ["--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 22), "--temperature", "0"]
# Makes every request fail in the engine (its test-only fault injector), as a crashed step would.
FAULTY = """
import sys
from platform_core.engine.faults import FaultInjector
from platform_core.engine.llm_engine import LLMEngine
from platform_core.cli.main import main
init = LLMEngine.__init__
def faulty(self, config):
    init(self, config)
    self.faults = FaultInjector(every="postprocess")
LLMEngine.__init__ = faulty
sys.exit(main(sys.argv[1:]))
"""


def generate(model_dir, *args: str, env: dict | None = None, script: str | None = None):
    prefix = ["-c", script] if script else ["-m", "platform_core.cli.main"]
    return subprocess.run(
        [sys.executable, *prefix, "generate", "--model", str(model_dir), *FLAGS, *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="replace",
        env={**os.environ, "PYTHONIOENCODING": "utf-8:replace", **(env or {})},
        timeout=300,
    )


def greedy(model_dir, prompt: str, max_tokens: int, **engine_keys) -> tuple[str, int]:
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 22, **engine_keys)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    return out.text, len(out.token_ids)


def as_printed(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8", "replace")


def test_prints_each_prompt_with_its_continuation(model_dir):
    prompts = ["hello there", "the weather"]
    run = generate(model_dir, "--prompt", prompts[0], "--prompt", prompts[1], "--max-tokens", "6")
    assert run.returncode == 0, run.stderr
    texts = [prompt + greedy(model_dir, prompt, 6)[0] for prompt in prompts]
    assert run.stdout == as_printed(f"{texts[0]}\n\n{texts[1]}\n")


def test_default_length_runs_past_16_tokens_to_the_context_or_eos(model_dir):
    # A 64-token context caps the default (256) at the room the prompt leaves.
    run = generate(model_dir, "--prompt", "hello there", "--max-model-len", "64")
    assert run.returncode == 0, run.stderr
    text, num_tokens = greedy(model_dir, "hello there", 256, max_model_len=64)
    assert num_tokens > 16
    assert run.stdout == as_printed(f"hello there{text}\n")


def test_a_failed_request_exits_non_zero_with_its_error_on_stderr(model_dir):
    run = generate(model_dir, "--prompt", "hello there", "--max-tokens", "4", script=FAULTY)
    assert run.returncode == 1
    assert run.stdout == ""
    assert "error: the request for prompt 1 failed" in run.stderr
    assert "injected fault" in run.stderr


def test_says_it_compiles_kernels_before_it_does(model_dir, tmp_path):
    # A fresh cache compiles; CXX=false makes that compile fail at once (the torch fallback
    # then runs), so the line is seen without a minute of compiling.
    env = {"PLATFORM_CORE_CACHE": str(tmp_path / "cache"), "CXX": "false"}
    run = generate(model_dir, "--prompt", "hi", "--max-tokens", "2", env=env)
    assert run.returncode == 0, run.stderr
    assert "compiling the CPU kernels" in run.stderr and "about a minute" in run.stderr
    assert run.stdout.startswith("hi")
