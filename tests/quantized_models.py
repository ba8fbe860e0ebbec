"""Whole tiny models for the quantization tests: one greedy run of the same prompts, its
tokens and logprobs compared, and FP8 copies of a model directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.torch import load_file, save_file

from platform_core import LLM, SamplingParams
from platform_core.quantization.formats import FP8_E4M3, dequantize, quantize

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
PROMPTS = [[3, 17, 5], [9] * 21, list(range(4, 40))]
LINEARS_PER_MODEL = 8  # qkv, o, gate_up, down in each of the tiny model's 2 layers


def generate(model_dir, **engine):
    """The outputs of PARAMS on PROMPTS (24 tokens a step: the 36-token prompt prefills in two
    chunks beside the others' decodes), and the runner (its model stays usable after the
    engine shut down)."""
    with LLM(str(model_dir), block_size=16, max_num_batched_tokens=24, **engine) as llm:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
        llm.check_kv_integrity()
        return [o.outputs[0] for o in outputs], llm.engine.runner


def tokens_and_logprobs(outputs) -> list[tuple[list[int], list[float]]]:
    """Each output's tokens and the logprob of each."""
    return [
        (list(o.token_ids), [next(iter(lp.values())).logprob for lp in o.logprobs]) for o in outputs
    ]


def assert_same(a, b, atol: float = 1e-4) -> None:
    """The same tokens, and their logprobs within ``atol``."""
    ours, theirs = tokens_and_logprobs(a), tokens_and_logprobs(b)
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, x), (_, y) in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(x, y, atol=atol)


def copy_config(model_dir: Path, out: Path, quantization_config: dict | None = None) -> None:
    """Every file of ``model_dir`` but the weights into ``out``, with ``quantization_config``
    added to ``config.json``."""
    out.mkdir()
    for item in model_dir.iterdir():
        if item.suffix != ".safetensors":
            (out / item.name).write_bytes(item.read_bytes())
    if quantization_config is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (out / "config.json").write_text(json.dumps(config))


def fp8_exact_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with every linear's weight replaced by its FP8 round trip (16/32-bit), so
    that quantizing it again at load time loses nothing: the dense model is the FP8 model."""
    copy_config(model_dir, out)
    tensors = load_file(model_dir / "model.safetensors")
    for name, value in tensors.items():
        if name.endswith("proj.weight"):
            tensors[name] = dequantize(quantize(value, FP8_E4M3), FP8_E4M3).to(value.dtype)
    save_file(tensors, out / "model.safetensors", {"format": "pt"})
    return out
