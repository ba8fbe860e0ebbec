"""The GPU backends' FP8 Triton kernel (issue #25) against the reference op under Triton's
interpreter, in a child process (this file run as a script, as ``test_triton_kernels.py``
does): kernel cases across shapes and dtypes, and a whole tiny model through it giving the
reference op's tokens. ``PLATFORM_CORE_KERNEL_DEVICE=cuda`` runs the kernel cases compiled on a
GPU instead (the whole-model case needs the interpreter: it is skipped).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from json_child import collect, start_child
from quantized_models import (
    LINEARS_PER_MODEL,
    PARAMS,
    fp8_exact_copy,
    generate,
    tokens_and_logprobs,
)

from platform_core.kernels.triton import triton_installed
from platform_core.quantization.formats import (
    FP8_E4M3,
    FP8_MAX,
    fp8_rows,
    has_kernel,
    quantize,
    quantized_linear,
)

MODEL_ENV = "PLATFORM_CORE_FP8_TEST_MODEL"
DEVICE_ENV = "PLATFORM_CORE_KERNEL_DEVICE"  # as in test_triton_kernels.py
# The kernel's error, relative to the largest output: float32 accumulation over <= 300 inputs,
# then the output narrowed to the dtype: half an ulp in float16 (2^-11); a whole one in bfloat16
# (2^-7), which Triton's interpreter narrows by truncation (a GPU rounds to nearest).
KERNEL_TOLERANCE = {"float32": 1e-5, "bfloat16": 8e-3, "float16": 6e-4}


@pytest.fixture(scope="module")
def fp8_model(tiny_model_dir, tmp_path_factory) -> Path:
    return fp8_exact_copy(tiny_model_dir("llama"), tmp_path_factory.mktemp("fp8") / "m")


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
    reference, _ = generate(model_dir, **common)
    launches = []
    kernel = triton_op.triton_fp8_linear

    def counted(*args):
        launches.append(args[0].shape[0])
        return kernel(*args)

    triton_op.triton_fp8_linear = counted
    TemplateBackend.op_overrides = lambda self: triton_op_overrides()
    triton, _ = generate(model_dir, **common)
    return {
        "reference": tokens_and_logprobs(reference),
        "triton": tokens_and_logprobs(triton),
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
