"""Whole tiny models for the quantization tests: one greedy run of the same prompts, its
tokens and logprobs compared, and FP8 copies of a model directory (16/32-bit, or stored in
FP8 with their scales)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from platform_core import LLM, SamplingParams
from platform_core.quantization.formats import FP8_E4M3, FP8_MAX, dequantize, quantize

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


def write_fp8_checkpoint(
    model_dir: Path,
    out: Path,
    config: dict,
    per_tensor: Callable[[str], bool],
    dense: Callable[[str], bool] = lambda _name: False,
    tensor_scale_shape: tuple[int, ...] = (),
    input_scale: bool = True,
) -> Path:
    """``model_dir`` stored in FP8 under ``quantization_config`` ``config``: each linear's weight
    but the ``dense`` ones as float8 e4m3 with a float32 ``weight_scale``, one (of shape
    ``tensor_scale_shape``) for the tensor where ``per_tensor`` names it, else one per output row
    (``[out, 1]``); with ``input_scale``, a static activation scale (1) beside each."""
    copy_config(model_dir, out, config)
    tensors = load_file(model_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith("proj.weight") and not dense(n)]:
        weight = tensors[name].float()
        if per_tensor(name):
            amax = weight.abs().max().reshape(tensor_scale_shape)
        else:
            amax = weight.abs().amax(1, keepdim=True)
        scale = amax / FP8_MAX
        tensors[name] = (weight / scale).to(torch.float8_e4m3fn)
        tensors[f"{name}_scale"] = scale
        if input_scale:
            tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(1.0)
    save_file(tensors, out / "model.safetensors", {"format": "pt"})
    return out
