"""FP8 weights (issue #25): float8 e4m3 with a float32 scale per output row.

The format's decoding against torch's own float8, quantizing 16/32-bit weights at load time,
the GPU backends' Triton kernel against the reference op under Triton's interpreter (in a child
process: this file run as a script, as ``test_triton_kernels.py`` does), whole tiny models
quantized in the test (through the reference op, through the Triton kernel, and under tensor
parallelism), and the refusals. ``PLATFORM_CORE_KERNEL_DEVICE=cuda`` runs the kernel cases
compiled on a GPU instead (the whole-model case needs the interpreter: it is skipped).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from json_child import collect, start_child
from safetensors.torch import load_file, save_file

from platform_core import LLM, SamplingParams
from platform_core.errors import ConfigError, ModelLoadError
from platform_core.kernels.triton import triton_installed
from platform_core.quantization.formats import (
    FP8_E4M3,
    FP8_MAX,
    Q8_0,
    dequantize,
    fp8_rows,
    has_kernel,
    quantize,
    quantized_linear,
)

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
PROMPTS = [[3, 17, 5], [9] * 21, list(range(4, 40))]
MODEL_ENV = "PLATFORM_CORE_FP8_TEST_MODEL"
DEVICE_ENV = "PLATFORM_CORE_KERNEL_DEVICE"  # as in test_triton_kernels.py
# The kernel's error, relative to the largest output: float32 accumulation over <= 300 inputs,
# then the output narrowed to the dtype: half an ulp in float16 (2^-11); a whole one in bfloat16
# (2^-7), which Triton's interpreter narrows by truncation (a GPU rounds to nearest).
KERNEL_TOLERANCE = {"float32": 1e-5, "bfloat16": 8e-3, "float16": 6e-4}
LINEARS_PER_MODEL = 8  # qkv, o, gate_up, down in each of 2 layers


def test_every_e4m3_code_decodes_as_torch_does():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    rows = fp8_rows(codes.view(torch.float8_e4m3fn).unsqueeze(0), torch.tensor(1.0))
    ours = dequantize(rows, FP8_E4M3)[0]
    theirs = codes.view(torch.float8_e4m3fn).float()
    assert ours.isnan().tolist() == theirs.isnan().tolist()
    assert torch.equal(ours.nan_to_num(0.0), theirs.nan_to_num(0.0))


def test_row_scales_decode_exactly():
    """float32 scales from subnormal to huge, one per row, times the code for 1.0."""
    scales = torch.tensor([1e-42, 2.5e-39, 3.1e-20, 1 / 448, 0.0, 1.0, 7.25, 3.0e38])
    one = torch.ones(len(scales), 3).to(torch.float8_e4m3fn)
    rows = fp8_rows(one, scales.unsqueeze(1))
    assert rows.shape == (len(scales), 4 + 3) and rows.dtype == torch.uint8
    assert torch.equal(dequantize(rows, FP8_E4M3), scales.unsqueeze(1).expand(-1, 3))
    # a per-tensor scale is the same scale in every row
    assert torch.equal(dequantize(fp8_rows(one, torch.tensor(2.0)), FP8_E4M3), 2 * one.float())


def test_quantizing_scales_each_row_by_its_largest_weight_and_rounds_to_nearest():
    weights = torch.randn(6, 300) * torch.logspace(-3, 2, 6).unsqueeze(1)
    weights[2] = 0.0
    rows = quantize(weights, FP8_E4M3)
    restored = dequantize(rows, FP8_E4M3)
    expected_scale = weights.abs().amax(1, keepdim=True) / FP8_MAX
    codes = (weights / expected_scale.clamp_min(1e-30)).to(torch.float8_e4m3fn).float()
    torch.testing.assert_close(restored, codes * expected_scale, rtol=1e-6, atol=0.0)
    assert torch.equal(restored[2], torch.zeros(300))
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each weight with a normal code (>= 2^-6)
    big = weights.abs() >= expected_scale * 2**-6
    assert ((restored - weights).abs()[big] <= weights.abs()[big] * 2**-4).all()
    # a column shard keeps the whole row's scale: the same bytes as the whole row's columns
    shard = quantize(weights, FP8_E4M3, slice(100, 250))
    assert torch.equal(shard[:, :4], rows[:, :4])
    assert torch.equal(shard[:, 4:], rows[:, 104:254])


def test_the_reference_op_keeps_the_input_dtype_and_adds_the_bias():
    rows = quantize(torch.randn(5, 40), FP8_E4M3)
    x, bias = torch.randn(3, 40), torch.randn(5)
    expected = x @ dequantize(rows, FP8_E4M3).T + bias
    torch.testing.assert_close(quantized_linear(x, rows, FP8_E4M3, bias), expected)
    assert quantized_linear(x.bfloat16(), rows, FP8_E4M3, None).dtype == torch.bfloat16


def test_non_finite_weights_are_refused():
    weights = torch.randn(4, 8)
    weights[1, 3] = torch.inf
    with pytest.raises(ValueError, match="finite"):
        quantize(weights, FP8_E4M3)


def _generate(model_dir, **kwargs):
    """The outputs, and the runner (its model stays usable after the engine shut down)."""
    with LLM(str(model_dir), block_size=16, max_num_batched_tokens=24, **kwargs) as llm:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
        llm.check_kv_integrity()
        return [o.outputs[0] for o in outputs], llm.engine.runner


def _tokens_and_logprobs(outputs) -> list[tuple[list[int], list[float]]]:
    return [
        (list(o.token_ids), [next(iter(lp.values())).logprob for lp in o.logprobs]) for o in outputs
    ]


def _assert_same(a, b, atol: float = 1e-4):
    ours, theirs = _tokens_and_logprobs(a), _tokens_and_logprobs(b)
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, x), (_, y) in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(x, y, atol=atol)


def _copy_config(model_dir: Path, out: Path, quantization_config: dict | None = None) -> None:
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


def _fp8_exact_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir`` with every linear's weight replaced by its FP8 round trip (16/32-bit), so
    that quantizing it again at load time loses nothing: the dense model is the FP8 model."""
    _copy_config(model_dir, out)
    tensors = load_file(model_dir / "model.safetensors")
    for name, value in tensors.items():
        if name.endswith("proj.weight"):
            tensors[name] = dequantize(quantize(value, FP8_E4M3), FP8_E4M3).to(value.dtype)
    save_file(tensors, out / "model.safetensors", {"format": "pt"})
    return out


@pytest.fixture(scope="module")
def fp8_model(tiny_model_dir, tmp_path_factory) -> Path:
    return _fp8_exact_copy(tiny_model_dir("llama"), tmp_path_factory.mktemp("fp8") / "m")


def test_a_model_quantized_to_fp8_gives_the_dense_models_tokens(fp8_model, caplog):
    """Through the reference op (the template backend has no quantized_linear of its own)."""
    common = {"backend": "template", "dtype": "float32"}
    with caplog.at_level(logging.INFO, logger="platform_core.models"):
        quantized, runner = _generate(fp8_model, quantization="fp8", **common)
    assert runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL}"
    assert "the FP8_E4M3 layers run the core's reference op" in caplog.text
    dense, dense_runner = _generate(fp8_model, **common)
    assert dense_runner.quantization is None
    assert runner.weights_bytes < dense_runner.weights_bytes
    assert runner.parameter_count == dense_runner.parameter_count
    _assert_same(quantized, dense)


def test_the_cpu_backend_runs_fp8_through_the_reference_op_and_says_so(fp8_model, caplog):
    """Its one-token steps are traced, so the op's decoding of the bytes must trace too."""
    common = {"backend": "cpu", "dtype": "float32"}
    with caplog.at_level(logging.INFO, logger="platform_core.models"):
        quantized, runner = _generate(fp8_model, quantization="fp8", **common)
    assert runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL}"
    assert "the FP8_E4M3 layers run the core's reference op" in caplog.text
    _assert_same(quantized, _generate(fp8_model, **common)[0], atol=1e-3)


def test_an_op_names_the_formats_it_has_kernels_for():
    def op(x, qweight, fmt, bias):
        raise AssertionError("never called")

    assert not has_kernel(None, FP8_E4M3) and not has_kernel(quantized_linear, FP8_E4M3)
    # one that names none has the GGML block formats' kernels (written before FP8 joined)
    assert has_kernel(op, Q8_0) and not has_kernel(op, FP8_E4M3)
    op.kernel_formats = frozenset({"FP8_E4M3"})
    assert has_kernel(op, FP8_E4M3) and not has_kernel(op, Q8_0)


def test_a_16_bit_checkpoint_quantized_to_fp8_rates_its_tokens_like_the_float_model(
    tiny_model_dir,
):
    """The first token of each prompt is one the float model rates near its own best (e4m3
    keeps 3 mantissa bits: looser than int8's bound, tighter than int4's)."""
    model_dir = tiny_model_dir("llama")
    first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in [*PROMPTS, [7, 8], [200] * 9]]

    def run(**kwargs):
        with LLM(str(model_dir), backend="template", dtype="float32", **kwargs) as llm:
            return [o.outputs[0] for o in llm.generate(prompts, first, use_tqdm=False)]

    for ours, theirs in zip(run(quantization="fp8"), run(), strict=True):
        token = ours.token_ids[0]
        assert token in theirs.logprobs[0]
        assert abs(theirs.logprobs[0][token].logprob - ours.logprobs[0][token].logprob) < 0.15


def test_tensor_parallel_ranks_quantize_their_shards_and_give_one_rank_tokens(tiny_model_dir):
    """Row shards take their rows' scales; column shards (o_proj, down_proj) the whole row's,
    so two ranks hold exactly the weights one rank does."""
    model_dir = tiny_model_dir("llama")
    common = {"backend": "template", "dtype": "float32", "quantization": "fp8"}
    one, _ = _generate(model_dir, **common)
    two, runner = _generate(model_dir, tensor_parallel_size=2, **common)
    assert runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL}"
    _assert_same(two, one)


def test_bad_input_is_refused_with_a_typed_error(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="quantization='fp4' is not supported"):
        LLM(str(tiny_model_dir("llama")), quantization="fp4")
    broken = _fp8_exact_copy(tiny_model_dir("llama"), tmp_path / "inf")
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = torch.inf
    save_file(tensors, broken / "model.safetensors", {"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj.*finite"):
        LLM(str(broken), backend="template", quantization="fp8")


FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "static"}


def _write_fp8_checkpoint(model_dir: Path, out: Path, config: dict = FP8_CONFIG) -> Path:
    """``model_dir`` stored in FP8 the Hugging Face way: each linear's weight as float8 e4m3
    with a float32 ``weight_scale``, one per output row, but one for the whole tensor in the
    ``q_proj`` and ``down_proj`` weights; a static ``input_scale`` beside each."""
    _copy_config(model_dir, out, config)
    tensors = load_file(model_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        weight = tensors[name].float()
        per_tensor = name.endswith(("q_proj.weight", "down_proj.weight"))
        amax = weight.abs().max() if per_tensor else weight.abs().amax(1, keepdim=True)
        scale = amax / FP8_MAX
        tensors[name] = (weight / scale).to(torch.float8_e4m3fn)
        tensors[f"{name}_scale"] = scale
        tensors[name.removesuffix("weight") + "input_scale"] = torch.tensor(1.0)
    save_file(tensors, out / "model.safetensors", {"format": "pt"})
    return out


def _dequantized_copy(fp8_dir: Path, out: Path) -> Path:
    """The FP8 checkpoint ``fp8_dir`` as float32 weights (``weight * weight_scale``)."""
    _copy_config(fp8_dir, out)
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(fp8_dir / "model.safetensors")
    dense = {
        name: value.float() * tensors.get(f"{name}_scale", torch.tensor(1.0))
        for name, value in tensors.items()
        if not name.endswith("_scale")
    }
    save_file(dense, out / "model.safetensors", {"format": "pt"})
    return out


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """An FP8 checkpoint of the tiny model, and the same weights dequantized."""
    root = tmp_path_factory.mktemp("fp8-checkpoint")
    stored = _write_fp8_checkpoint(tiny_model_dir("llama"), root / "fp8")
    return stored, _dequantized_copy(stored, root / "dense")


def test_an_fp8_checkpoint_is_kept_as_stored_and_gives_its_dequantized_tokens(fp8_checkpoint):
    stored, dense_dir = fp8_checkpoint
    common = {"backend": "template", "dtype": "float32"}
    quantized, runner = _generate(stored, quantization="fp8", **common)
    assert runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL}"
    tensors = load_file(stored / "model.safetensors")
    layers = dict(runner.model.named_modules())
    for part in ("mlp.down_proj", "self_attn.o_proj"):  # per tensor, per row
        name = f"model.layers.1.{part}.weight"
        want = fp8_rows(tensors[name], tensors[f"{name}_scale"])
        assert torch.equal(layers[f"model.layers.1.{part}"].weight, want), name
    _assert_same(quantized, _generate(dense_dir, **common)[0])


@pytest.mark.parametrize("backend", ["template", "cpu"])
def test_an_fp8_checkpoint_runs_dequantized_where_the_backend_has_no_kernel(
    fp8_checkpoint, caplog, backend
):
    """Dequantized once at load: the reference op would dequantize on every step."""
    stored, dense_dir = fp8_checkpoint
    with caplog.at_level(logging.INFO, logger="platform_core.engine"):
        outputs, runner = _generate(stored, backend=backend)
    assert runner.quantization is None
    # no op at all, or (the CPU backend's) one without an FP8 kernel
    assert re.search(rf"backend {backend}('s quantized_linear)? has no \w* ?kernel", caplog.text)
    assert "quantization='fp8' to keep them" in caplog.text
    _assert_same(outputs, _generate(dense_dir, backend=backend)[0], atol=1e-3)


def test_an_fp8_checkpoint_under_tensor_parallelism_gives_one_rank_tokens(fp8_checkpoint):
    stored, _ = fp8_checkpoint
    common = {"backend": "template", "dtype": "float32", "quantization": "fp8"}
    one, _ = _generate(stored, **common)
    two, runner = _generate(stored, tensor_parallel_size=2, **common)
    assert runner.quantization == f"quantized FP8_E4M3 x {LINEARS_PER_MODEL}"
    _assert_same(two, one)


def test_fp8_checkpoints_we_cannot_load_are_refused_naming_why(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    blockwise = {**FP8_CONFIG, "weight_block_size": [128, 128]}
    stored = _write_fp8_checkpoint(model_dir, tmp_path / "blockwise", blockwise)
    with pytest.raises(ModelLoadError, match=r"block-wise scales \(weight_block_size \[128, 128\]"):
        LLM(str(stored), backend="template", quantization="fp8")
    stored = _write_fp8_checkpoint(model_dir, tmp_path / "unscaled")
    tensors = load_file(stored / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(tensors, stored / "model.safetensors", {"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"up_proj.weight' is stored as float8 but .* no"):
        LLM(str(stored), backend="template", quantization="fp8")
    # scales that fit neither the tensor nor its rows (one per two rows)
    name = "model.layers.0.mlp.up_proj.weight_scale"
    tensors[name] = torch.ones(tensors["model.layers.0.mlp.up_proj.weight"].shape[0] // 2, 1)
    save_file(tensors, stored / "model.safetensors", {"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"up_proj.weight_scale has shape \(\d+, 1\)"):
        LLM(str(stored), backend="template", quantization="fp8")


@pytest.fixture(scope="module")
def interpreted(fp8_model) -> dict:
    """The kernel and whole-model cases, run in a child under Triton's interpreter."""
    if not triton_installed():
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env[MODEL_ENV] = str(fp8_model)
    if env.setdefault(DEVICE_ENV, "cpu") == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return collect(start_child(__file__, "interpreted", env), "fp8 kernel")


def _case_id(m: int, k: int, n: int, dtype: str, bias: bool, per_tensor: bool) -> str:
    return f"{dtype}-{m}x{k}->{n}" + "-bias" * bias + "-per-tensor" * per_tensor


# rows, inputs, outputs, activation dtype, bias, one scale for the tensor
KERNEL_CASES = {
    _case_id(*case): case
    for case in [
        (1, 64, 48, "float32", True, False),
        (1, 131, 37, "bfloat16", False, False),
        (7, 200, 70, "float16", True, False),
        (16, 96, 33, "float32", False, True),
        (33, 67, 65, "bfloat16", True, False),
        (128, 64, 40, "float32", False, False),  # the kernel's last size
        (129, 64, 40, "float32", True, False),  # dequantize, then the GEMM
    ]
}


def _kernel_case(m, k, n, dtype, bias, per_tensor, device: str) -> dict:
    from platform_core.kernels.triton.quantized_linear import quantized_linear_op

    gen = torch.Generator().manual_seed(m * 1000 + k)
    weights = torch.randn(n, k, generator=gen) * k**-0.5
    weights *= torch.logspace(-2, 1, n).unsqueeze(1)  # rows of very different scales
    if per_tensor:
        scale = weights.abs().max() / FP8_MAX
        rows = fp8_rows((weights / scale).to(torch.float8_e4m3fn), scale)
    else:
        rows = quantize(weights, FP8_E4M3)
    x = torch.randn(m, k, generator=gen).to(getattr(torch, dtype))
    b = torch.randn(n, generator=gen).to(x.dtype) if bias else None
    on_device = None if b is None else b.to(device)
    got = quantized_linear_op(x.to(device), rows.to(device), FP8_E4M3, on_device).cpu()
    want = quantized_linear(x.double(), rows, FP8_E4M3, None if b is None else b.double())
    return {
        "dtype": str(got.dtype).removeprefix("torch."),
        "shape": list(got.shape),
        "relative_error": ((got.double() - want).abs().max() / want.abs().max()).item(),
    }


def _interpreted_model() -> dict:
    """The fp8 model's tokens through the reference op, then through the GPU backends' Triton
    ops (given to the template backend here: the GPU backends need their device), counting the
    FP8 kernel's launches."""
    from platform_core_template.plugin import TemplateBackend

    from platform_core.backend_api import triton_op_overrides
    from platform_core.kernels.triton import quantized_linear as triton_op

    model_dir = os.environ[MODEL_ENV]
    common = {"backend": "template", "dtype": "float32", "quantization": "fp8"}
    reference, _ = _generate(model_dir, **common)
    launches = []
    kernel = triton_op.triton_fp8_linear

    def counted(*args):
        launches.append(args[0].shape[0])
        return kernel(*args)

    triton_op.triton_fp8_linear = counted
    TemplateBackend.op_overrides = lambda self: triton_op_overrides()
    triton, _ = _generate(model_dir, **common)
    return {
        "reference": _tokens_and_logprobs(reference),
        "triton": _tokens_and_logprobs(triton),
        "kernel_launches": len(launches),
        "declares_fp8": has_kernel(triton_op.quantized_linear_op, FP8_E4M3),
    }


def _child_main() -> None:
    device = os.environ[DEVICE_ENV]
    kernels = {name: _kernel_case(*case, device) for name, case in KERNEL_CASES.items()}
    model = _interpreted_model() if device == "cpu" else None
    print(json.dumps({"kernels": kernels, "model": model}))


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_the_triton_kernel_matches_the_reference_op(interpreted, name):
    m, _, n, dtype, _, _ = KERNEL_CASES[name]
    result = interpreted["kernels"][name]
    assert result["dtype"] == dtype and result["shape"] == [m, n]
    assert result["relative_error"] <= KERNEL_TOLERANCE[dtype], result


def test_a_model_through_the_triton_kernel_gives_the_reference_ops_tokens(interpreted):
    model = interpreted["model"]
    if model is None:
        pytest.skip("the template backend's model runs on the CPU: interpreter only")
    assert model["declares_fp8"]
    # every step: the 8 linears of the model (prefill chunks and decodes alike: <= 128 rows)
    assert model["kernel_launches"] >= LINEARS_PER_MODEL * PARAMS.max_tokens
    triton, reference = model["triton"], model["reference"]
    assert [t for t, _ in triton] == [t for t, _ in reference]
    for (_, x), (_, y) in zip(triton, reference, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-4)


if __name__ == "__main__" and sys.argv[1:] == ["interpreted"]:
    _child_main()
