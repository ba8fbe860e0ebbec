"""Prefill interference (issue #23): steady decode streams beside long prompts, colocated and
disaggregated, side by side in one run.

Phases, each ``--duration`` seconds of the same steady decode traffic (``--streams`` streams of
``--decode-prompt-len``-token prompts generating ``--decode-output-len`` tokens, EOS ignored,
each restarted as it finishes; a phase ends when the streams started before its end finish):

- ``baseline``: one colocated instance (``serve``, all cores), steady decodes only;
- ``colocated``: the same instance, the same decodes, while long prompts
  (``--long-prompt-len`` tokens, ``--long-output-len`` generated) keep arriving:
  ``--long-in-flight M`` of them at all times (the default, 1), or one every
  ``--long-interval K`` seconds;
- ``disagg-baseline``: a prefill instance (``kv_producer``) on ``--prefill-cpus`` and a decode
  instance (``kv_consumer``) on ``--decode-cpus`` (``taskset -c``; the CPU backend runs as
  many threads as its affinity has cores; default: half the cores each), behind
  ``platform-core proxy``, steady decodes only: what the split and the proxy cost;
- ``disaggregated``: the same instances, the same traffic as ``colocated``.

The proxy and this client stand in for a front end on other machines: they run on
``--front-cpus`` (default: the prefill instance's cores) in every phase, so the client's own
work never lands on the decode instance's cores (left unpinned, the scheduler moves it there
whenever the prefill core is busy, and the decode ITL measured would be the client's). Every
instance runs with the CPU backend's thread governor off unless
``PLATFORM_CORE_CPU_ADAPTIVE_THREADS`` is set: it would drop threads for the client's and the
other instances' load, and the split of the cores is what is measured.

Decode ITL is every gap between token-carrying chunks of the steady streams after their first
token (``platform_core.bench.serve.send_request``); long-prompt TTFT is from sending to the
first token. Prompts are token ids drawn from ``--token-id-range``, seeded by phase, kind and
index: the same on every run, and never one another's prefix. The table gives ITL p50/p99/max,
p99 over the baseline's (the issue's goal: disaggregated <= 1.2x), the steady streams'
tokens/s and TTFT, the long prompts' TTFT p50/p99, and failures; then the KV-transfer counters
of the decode and prefill instances over the disaggregated phase
(``platform_core.bench.kv_metrics``).

    python benchmarks/pd_interference.py [--quick] [--duration 60] [--streams 4]
        [--long-prompt-len 2048] [--long-in-flight 1 | --long-interval 10] [--model DIR]
        [--serve-args "--max-num-batched-tokens 512"] [--kv-extra-config JSON] [--base-port 8300]
        [--prefill-cpus 0 --decode-cpus 1] [--front-cpus 0] [--save-result F]

A full default run takes about 6 minutes on 2 cores; ``--quick`` about 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from platform_core.bench.kv_metrics import KVTransferDelta, KVTransferWatch
from platform_core.bench.metrics import RequestRecord, percentile
from platform_core.bench.report import machine_info, print_rows, save_result
from platform_core.bench.serve import ServeConfig, send_request
from platform_core.bench.workloads import BenchRequest, TokenSpace

REQUEST_TIMEOUT_S = 600.0
STOP_GRACE_S = 10.0
WARMUP_TOKENS = 16
ADAPTIVE_THREADS_ENV = "PLATFORM_CORE_CPU_ADAPTIVE_THREADS"  # the CPU backend's thread governor
QUICK = {
    "duration": 10.0,
    "streams": 2,
    "decode_output_len": 64,
    "long_prompt_len": 512,
    "long_output_len": 4,
}


# ---------------------------------------------------------------------------------- servers
@dataclass
class Server:
    """A ``platform-core`` child process, leader of its own process group."""

    name: str
    url: str
    process: subprocess.Popen
    log: Path

    def wait_healthy(self, timeout_s: float) -> None:
        """Return once ``/health`` answers 200; raise with the log's tail if the process exits
        or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode}{self.tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not healthy within {timeout_s:.0f} s{self.tail()}")

    def tail(self) -> str:
        return f"; its log ({self.log}) ends:\n" + self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL to what is left of it after ``STOP_GRACE_S``."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(STOP_GRACE_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the engine core, if it outlived us
        self.process.wait()


@contextlib.contextmanager
def servers(
    specs: list[tuple[str, list[str], int, str]], log_dir: Path, start_timeout_s: float
) -> Iterator[dict[str, Server]]:
    """Start ``(name, platform-core argv, port, taskset list)`` each, wait until all are
    healthy, yield them by name; stop them all on the way out, whatever happens."""
    env = {ADAPTIVE_THREADS_ENV: "0", **os.environ}  # fixed threads: see the module's doc
    with contextlib.ExitStack() as stack:
        started: dict[str, Server] = {}
        for name, argv, port, cpus in specs:
            log = log_dir / f"{name}.log"
            with log.open("w") as out:
                process = subprocess.Popen(
                    ["taskset", "-c", cpus, sys.executable, "-m", "platform_core.cli.main", *argv],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # a group of its own: stopped with its children
                )
            server = Server(name, f"http://127.0.0.1:{port}", process, log)
            stack.callback(server.stop)
            started[name] = server
        for server in started.values():
            server.wait_healthy(start_timeout_s)
        yield started


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class CoreSplit:
    """``taskset`` lists: every core this process may use (the colocated instance's), the
    prefill instance's, the decode instance's, and the front end's (the proxy and this
    client)."""

    everything: str
    prefill: str
    decode: str
    front: str

    @classmethod
    def of(cls, args: argparse.Namespace) -> CoreSplit:
        """The flags', or the cores this process may use: the first half for prefill, the rest
        for decode; the front end on the prefill half."""
        cpus = sorted(os.sched_getaffinity(0))
        if args.prefill_cpus:
            prefill, decode = args.prefill_cpus, args.decode_cpus
        elif len(cpus) < 2:
            raise SystemExit("disaggregation needs at least 2 cores to split")
        else:
            half = len(cpus) // 2
            prefill, decode = ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))
        return cls(",".join(map(str, cpus)), prefill, decode, args.front_cpus or prefill)


def cpu_set(taskset_list: str) -> set[int]:
    """The cores of a ``taskset -c`` list such as ``0,2-3``."""
    cores: set[int] = set()
    for part in taskset_list.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


# ---------------------------------------------------------------------------------- traffic
@dataclass(frozen=True)
class Traffic:
    """What each phase sends."""

    model: str
    streams: int
    decode_prompt_len: int
    decode_output_len: int
    long_prompt_len: int
    long_output_len: int
    long_in_flight: int
    long_interval_s: float | None
    duration_s: float
    token_ids: tuple[int, ...]

    def request(self, key: str, prompt_len: int, max_tokens: int) -> BenchRequest:
        """A prompt of random ids seeded by ``key`` (phase, kind, index): deterministic, and
        different for every key, so no prefix-cache hit hides a prefill."""
        rng = random.Random(key)
        return BenchRequest(max_tokens, rng.choices(self.token_ids, k=prompt_len))


@dataclass
class Phase:
    """What the client saw in one phase."""

    name: str
    decode: list[RequestRecord] = field(default_factory=list)
    long: list[RequestRecord] = field(default_factory=list)
    decode_s: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)
    kv: dict[str, KVTransferDelta | None] = field(default_factory=dict)  # by instance role

    @property
    def itl_ms(self) -> list[float]:
        return [gap * 1000 for r in self.decode if r.success for gap in r.itl]

    def summary(self) -> dict[str, Any]:
        """Decode ITL p50/p99/max (ms), tokens/s and TTFT p50 (s); long-prompt TTFT p50/p99
        (s); failures."""
        itl = self.itl_ms
        stream_ttft = [r.ttft for r in self.decode if r.success]
        ttft = [r.ttft for r in self.long if r.success]
        failed = [r for r in self.decode + self.long if not r.success]
        return {
            "itl_samples": len(itl),
            "itl_p50_ms": percentile(itl, 50) if itl else None,
            "itl_p99_ms": percentile(itl, 99) if itl else None,
            "itl_max_ms": max(itl, default=None),
            "decode_tokens_per_s": sum(r.output_len for r in self.decode if r.success)
            / self.decode_s,
            "decode_ttft_p50_s": percentile(stream_ttft, 50) if stream_ttft else None,
            "long_prompts": len(ttft),
            "long_ttft_p50_s": percentile(ttft, 50) if ttft else None,
            "long_ttft_p99_s": percentile(ttft, 99) if ttft else None,
            "failed": len(failed),
            "errors": sorted({r.error for r in failed})[:5],
            "load_average_before_after": list(self.load),
        }


async def run_phase(name: str, url: str, traffic: Traffic, with_long: bool) -> Phase:
    """Steady decode streams until ``traffic.duration_s`` has passed and the streams finish;
    long prompts beside them while they run when ``with_long``."""
    config = ServeConfig(base_url=url, model=traffic.model, timeout_s=REQUEST_TIMEOUT_S)
    phase = Phase(name)
    decodes_done = asyncio.Event()
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:

        async def long_prompt(key: str) -> None:
            request = traffic.request(
                f"{name}/long/{key}", traffic.long_prompt_len, traffic.long_output_len
            )
            phase.long.append(await send_request(client, config, request))

        async def long_slot(slot: int) -> None:
            index = 0
            while not decodes_done.is_set():
                await long_prompt(f"{slot}-{index}")
                index += 1

        async def long_arrivals(interval_s: float) -> None:
            tasks = []
            while not decodes_done.is_set():
                tasks.append(asyncio.create_task(long_prompt(str(len(tasks)))))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(decodes_done.wait(), interval_s)
            await asyncio.gather(*tasks)

        async def steady(stream: int, deadline: float) -> None:
            index = 0
            while time.perf_counter() < deadline:
                key = f"{name}/decode/{stream}-{index}"
                request = traffic.request(key, traffic.decode_prompt_len, traffic.decode_output_len)
                phase.decode.append(await send_request(client, config, request))
                index += 1

        load = os.getloadavg()[0]
        start = time.perf_counter()
        if not with_long:
            long_task = None
        elif traffic.long_interval_s:
            long_task = asyncio.create_task(long_arrivals(traffic.long_interval_s))
        else:
            slots = (long_slot(slot) for slot in range(traffic.long_in_flight))
            long_task = asyncio.gather(*slots)
        deadline = start + traffic.duration_s
        await asyncio.gather(*(steady(stream, deadline) for stream in range(traffic.streams)))
        phase.decode_s = time.perf_counter() - start
        decodes_done.set()
        if long_task is not None:
            await long_task
    phase.load = (load, os.getloadavg()[0])
    return phase


async def warm_up(url: str, traffic: Traffic) -> None:
    """One long prompt beside ``streams`` short requests (kernels, traced steps, the KV
    transfer's connection); raise if any fails."""
    config = ServeConfig(base_url=url, model=traffic.model, timeout_s=REQUEST_TIMEOUT_S)
    requests = [traffic.request("warmup/long", traffic.long_prompt_len, traffic.long_output_len)]
    requests += [
        traffic.request(f"warmup/decode/{i}", traffic.decode_prompt_len, WARMUP_TOKENS)
        for i in range(traffic.streams)
    ]
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:
        records = await asyncio.gather(*(send_request(client, config, r) for r in requests))
    errors = {r.error for r in records if not r.success}
    if errors:
        raise RuntimeError(f"warm-up requests to {url} failed: {sorted(errors)}")


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


# ---------------------------------------------------------------------------------- report
def _cell(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def table(summaries: dict[str, dict[str, Any]]) -> str:
    """The markdown table of the phases, ITL p99 as a ratio to the baseline's too."""
    baseline = summaries["baseline"]["itl_p99_ms"]
    lines = [
        "| mode | decode ITL p50 ms | ITL p99 ms | ITL max ms | p99 / baseline | decode tok/s "
        "| decode TTFT p50 s | long prompts | long TTFT p50 s | long TTFT p99 s | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summaries.items():
        p99 = s["itl_p99_ms"]
        ratio = f"{p99 / baseline:.2f}x" if p99 and baseline else "n/a"
        cells = [
            name,
            _cell(s["itl_p50_ms"], 1),
            _cell(s["itl_p99_ms"], 1),
            _cell(s["itl_max_ms"], 0),
            ratio,
            _cell(s["decode_tokens_per_s"], 1),
            _cell(s["decode_ttft_p50_s"], 2),
            str(s["long_prompts"]),
            _cell(s["long_ttft_p50_s"], 2),
            _cell(s["long_ttft_p99_s"], 2),
            str(s["failed"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main
@dataclass(frozen=True)
class Ports:
    """Where everything listens."""

    colocated: int
    prefill: int
    decode: int
    proxy: int
    kv: int

    @classmethod
    def pick(cls, base: int | None) -> Ports:
        """``base`` and the next four, or free ports."""
        return cls(*(base + i if base else free_port() for i in range(5)))


def serve_argv(args: argparse.Namespace, port: int, transfer: dict | None = None) -> list[str]:
    argv = ["serve", "--port", str(port), *shlex.split(args.serve_args)]
    if args.model:
        argv += ["--model", args.model]
    if transfer:
        argv.append("--kv-transfer-config=" + json.dumps(transfer))
    return argv


def note(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run_setup(
    args: argparse.Namespace,
    traffic: Traffic,
    specs: list[tuple[str, list[str], int, str]],
    names: tuple[str, str],
    log_dir: Path,
    kv_urls: dict[str, str] | None = None,
) -> dict[str, Phase]:
    """Start ``specs`` (the last one is the front clients talk to), warm up, and run the two
    phases ``names``: decodes only, then beside long prompts, with the KV-transfer counters
    of ``kv_urls`` (by role) over the second."""
    log_dir.mkdir(parents=True, exist_ok=True)
    phases: dict[str, Phase] = {}
    with servers(specs, log_dir, args.start_timeout) as started:
        url = started[specs[-1][0]].url
        traffic = replace(traffic, model=served_model(url))
        asyncio.run(warm_up(url, traffic))
        for name, with_long in zip(names, (False, True)):
            note(f"{name}: {args.duration:g} s and the streams' tails")
            watch = KVTransferWatch(list(kv_urls.values())) if kv_urls and with_long else None
            phases[name] = asyncio.run(run_phase(name, url, traffic, with_long))
            if watch is not None:
                deltas = watch.deltas()
                phases[name].kv = {role: deltas[at] for role, at in kv_urls.items()}
    return phases


def colocated_phases(
    args: argparse.Namespace, traffic: Traffic, ports: Ports, log_dir: Path, cores: CoreSplit
) -> dict[str, Phase]:
    """``baseline`` and ``colocated`` on one instance with all cores."""
    note(f"starting the colocated instance (cpus {cores.everything})")
    argv = serve_argv(args, ports.colocated)
    spec = [("colocated", argv, ports.colocated, cores.everything)]
    return run_setup(args, traffic, spec, ("baseline", "colocated"), log_dir)


def disaggregated_phases(
    args: argparse.Namespace, traffic: Traffic, ports: Ports, log_dir: Path, cores: CoreSplit
) -> dict[str, Phase]:
    """``disagg-baseline`` and ``disaggregated``: prefill and decode instances on their halves
    of the cores, behind the proxy."""
    note(
        f"starting prefill (cpus {cores.prefill}), decode (cpus {cores.decode}) and the proxy "
        f"(cpus {cores.front})"
    )
    extra = {"kv_connector_extra_config": args.kv_extra_config} if args.kv_extra_config else {}
    producer = {"kv_connector": "tcp", "kv_role": "kv_producer", "kv_port": ports.kv, **extra}
    consumer = {"kv_connector": "tcp", "kv_role": "kv_consumer", **extra}
    urls = {role: f"http://127.0.0.1:{getattr(ports, role)}" for role in ("decode", "prefill")}
    proxy_argv = ["proxy", "--prefill", urls["prefill"], "--decode", urls["decode"]]
    specs = [
        ("prefill", serve_argv(args, ports.prefill, producer), ports.prefill, cores.prefill),
        ("decode", serve_argv(args, ports.decode, consumer), ports.decode, cores.decode),
        ("proxy", [*proxy_argv, "--port", str(ports.proxy)], ports.proxy, cores.front),
    ]
    names = ("disagg-baseline", "disaggregated")
    return run_setup(args, traffic, specs, names, log_dir, urls)


def report(args: argparse.Namespace, phases: dict[str, Phase]) -> dict[str, Any]:
    """Print the settings, the table, the ratios and the KV counters; the result as a dict."""
    machine = machine_info()
    summaries = {name: phase.summary() for name, phase in phases.items()}
    long_load = (
        f"one every {args.long_interval:g} s"
        if args.long_interval
        else f"{args.long_in_flight} in flight"
    )
    print(
        f"cpu flags: {' '.join(machine['cpu_flags']) or '-'}; cores {machine['cpu_count']}; "
        f"{args.streams} streams x {args.decode_prompt_len}+{args.decode_output_len} tokens; "
        f"long prompts {args.long_prompt_len}+{args.long_output_len} tokens, {long_load}; "
        f"{args.duration:g} s per phase"
    )
    print(table(summaries))
    for name, base, goal in (
        ("colocated", "baseline", ""),
        ("disaggregated", "baseline", " (issue #23's goal: <= 1.2x)"),
        ("disaggregated", "disagg-baseline", " (what the long prompts add there)"),
    ):
        p99, base_p99 = summaries[name]["itl_p99_ms"], summaries[base]["itl_p99_ms"]
        if p99 and base_p99:
            print(f"decode ITL p99 {name} / {base}: {p99 / base_p99:.2f}x{goal}")
    for name, s in summaries.items():
        before, after = s["load_average_before_after"]
        errors = "; errors: " + " | ".join(s["errors"]) if s["errors"] else ""
        print(f"{name}: {s['itl_samples']} ITL samples, load {before:.2f} -> {after:.2f}{errors}")
    kv = phases["disaggregated"].kv
    for role, delta in kv.items():
        if delta is not None:
            print_rows(f"KV transfer, {role} instance, disaggregated phase", delta.rows())
    return {
        "phases": summaries,
        "kv_transfer": {role: d.to_dict() for role, d in kv.items() if d is not None},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    parser.add_argument("--streams", type=int, default=4, help="steady decode streams")
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--decode-output-len", type=int, default=256)
    parser.add_argument(
        "--long-prompt-len", type=int, default=2048, help="tokens (up to 8k on the default model)"
    )
    parser.add_argument("--long-output-len", type=int, default=16)
    arrivals = parser.add_mutually_exclusive_group()
    arrivals.add_argument(
        "--long-in-flight", type=int, default=1, help="long prompts kept in flight (default)"
    )
    arrivals.add_argument(
        "--long-interval", type=float, default=None, help="instead: one long prompt every K s"
    )
    parser.add_argument("--model", default=None, help="(default: the packaged default model)")
    parser.add_argument(
        "--serve-args", default="", help="more flags for every engine instance, one string"
    )
    parser.add_argument(
        "--token-id-range",
        type=TokenSpace.parse,
        default=TokenSpace(1000, 30000),
        help="prompt token ids LOW:HIGH (default: 1000:30000, inside any Llama vocabulary)",
    )
    parser.add_argument(
        "--kv-extra-config",
        type=json.loads,
        default=None,
        help="the connector's kv_connector_extra_config on both instances, JSON (e.g. "
        "'{\"verify_checksums\": false}')",
    )
    parser.add_argument("--prefill-cpus", help="taskset list (default: the first half)")
    parser.add_argument("--decode-cpus", help="taskset list (default: the second half)")
    parser.add_argument(
        "--front-cpus", help="taskset list for the proxy and this client (default: prefill's)"
    )
    parser.add_argument(
        "--base-port",
        type=int,
        default=None,
        help="colocated, prefill, decode, proxy and KV ports are this and the next four "
        "(default: free ports)",
    )
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds per setup")
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    parser.add_argument("--save-result", metavar="FILE", help="write the result as JSON")
    args = parser.parse_args(argv)
    if args.quick:  # other defaults; flags given still win
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    if bool(args.prefill_cpus) != bool(args.decode_cpus):
        parser.error("--prefill-cpus and --decode-cpus go together")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not shutil.which("taskset"):
        raise SystemExit("taskset (util-linux) is needed to split the cores")
    # SIGTERM unwinds like Ctrl-C, so every server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    traffic = Traffic(
        model="",  # each setup's served name, once it is up
        streams=args.streams,
        decode_prompt_len=args.decode_prompt_len,
        decode_output_len=args.decode_output_len,
        long_prompt_len=args.long_prompt_len,
        long_output_len=args.long_output_len,
        long_in_flight=args.long_in_flight,
        long_interval_s=args.long_interval,
        duration_s=args.duration,
        token_ids=tuple(args.token_id_range.candidates()),
    )
    cores = CoreSplit.of(args)
    os.sched_setaffinity(0, cpu_set(cores.front))  # this client: see the module's doc
    ports = Ports.pick(args.base_port)
    with contextlib.ExitStack() as stack:
        log_dir = Path(
            args.log_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="pd-"))
        )
        phases = colocated_phases(args, traffic, ports, log_dir, cores)
        phases |= disaggregated_phases(args, traffic, ports, log_dir, cores)
    result = report(args, phases)
    if args.save_result:
        save_result(args.save_result, "pd_interference", vars(args), result)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)  # the servers are stopped by then
    except RuntimeError as exc:  # a server that did not come up or refused the warm-up
        sys.exit(f"pd_interference: {exc}")
