"""What the engine-core process costs per step: the transport of a step's outputs, and the
detokenization it keeps in the core (issue #26).

A real engine runs ``--requests`` streamed requests (with a stop string, so stop checks run)
until each has decoded ``--decoded`` tokens; meanwhile every step's time is split into
detokenization (``IncrementalDetokenizer.add``), stop-string checks and the rest. Then the last
two steps' outputs go through the protocol ``--iters`` times, timed part by part:

- encode: ``DeltaWriter.write`` (what is new since the previous step, as the core's
  ``CoreServer.deliver`` writes it from the step's outputs: the usual request in the columns of
  ``StepDeltas``, any other as a full ``RequestDelta``) and the msgpack encoding;
- send, in flight, receive: ZMQ over ``ipc://`` (ROUTER to DEALER, the sockets ``serve``
  uses), both ends in this process, so no scheduler hop is counted; the send and receive calls
  are the ends' own work, the time in flight is ZMQ's I/O threads (latency, which holds up
  neither end's loop);
- decode: msgpack back into the message structs;
- rebuild: the front's ``OutputAssembler`` making the cumulative ``RequestOutput``s (on the
  front's side of the GIL split, not the core's), checked equal to the engine's.

    python benchmarks/engine_transport.py [--model DIR] [--requests 256] [--decoded 64]
        [--logprobs N] [--iters 300]

The default model is the packaged SmolLM2-135M (its real 49k-token tokenizer); the numbers are
CPU time on this machine, printed with its load average.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import zmq

from platform_core.config import EngineConfig
from platform_core.engine import sequence_state
from platform_core.engine.core_messages import ENCODER, EVENT_DECODER, CoreBatch
from platform_core.engine.detokenizer import IncrementalDetokenizer
from platform_core.engine.llm_engine import LLMEngine
from platform_core.engine.output_assembly import OutputAssembler
from platform_core.engine.output_deltas import DeltaWriter
from platform_core.engine.request_stream import GenerateRequest
from platform_core.sampling_params import SamplingParams


def timed(spent: dict[str, float], key: str, function: Callable) -> Callable:
    """``function``, adding the seconds each call takes to ``spent[key]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - started

    return wrapper


def run_engine(args: argparse.Namespace) -> tuple[list, list, list[GenerateRequest], dict]:
    """Decode ``args.requests`` requests; the last two steps' outputs, the requests, and the
    per-step split of the steps once all requests were decoding."""
    config = EngineConfig.from_flat(
        model=args.model,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(2048, args.requests * 8),
        kv_cache_memory_bytes=4 << 30,
    )
    engine = LLMEngine(config)
    gc.collect()
    gc.freeze()  # as the engine-core process does once started
    params = SamplingParams(
        temperature=1.0,
        seed=0,
        max_tokens=args.decoded + 8,
        ignore_eos=True,
        stop=["\n\nUser:"],
        logprobs=args.logprobs,
    )
    requests = [
        GenerateRequest(f"r{i}", f"Request {i}: tell me about the number {i * 7}.", params)
        for i in range(args.requests)
    ]
    for r in requests:
        engine.add_request(r.request_id, r.prompt, r.params)
    spent: dict[str, float] = defaultdict(float)
    detokenizer_add = IncrementalDetokenizer.add
    find_stop = sequence_state.SampleState._find_stop
    IncrementalDetokenizer.add = timed(spent, "detok", detokenizer_add)
    sequence_state.SampleState._find_stop = timed(spent, "stop", find_stop)
    steps: dict[str, list[float]] = defaultdict(list)
    previous: list = []
    outputs: list = []
    try:
        while True:
            spent.clear()
            started = time.perf_counter()
            previous, outputs = outputs, engine.step()
            step = time.perf_counter() - started
            decoded = min(len(o.outputs[0].token_ids) for o in outputs) if outputs else 0
            if args.verbose:
                print(f"step {len(outputs)} outputs, {decoded} decoded: {step:.3f} s", flush=True)
            if len(outputs) == args.requests and decoded >= 2:
                steps["step"].append(step)
                steps["detok"].append(spent["detok"])
                steps["stop"].append(spent["stop"])
            if decoded >= args.decoded and len(previous) == args.requests:
                return previous, outputs, requests, steps
    finally:
        IncrementalDetokenizer.add = detokenizer_add
        sequence_state.SampleState._find_stop = find_stop


def time_transport(previous: list, current: list, requests: list, iters: int) -> dict:
    """Seconds per part for ``current`` sent after ``previous``, over ``iters`` rounds."""
    context = zmq.Context()
    directory = tempfile.mkdtemp(prefix="transport-")  # for the ipc socket
    core = context.socket(zmq.ROUTER)
    core.bind(f"ipc://{directory}/events")
    front = context.socket(zmq.DEALER)
    front.setsockopt(zmq.IDENTITY, b"front")
    front.connect(f"ipc://{directory}/events")
    front.send(b"hello")  # the core learns the route
    identity, _ = core.recv_multipart()
    parts: dict[str, list[float]] = defaultdict(list)
    size = 0
    by_id = attrgetter("request_id")
    for _ in range(iters):
        writer, assembler = DeltaWriter(), OutputAssembler()
        for r in requests:
            writer.expect(r)
            assembler.expect(r)
        assembler.apply(writer.write(previous))
        t0 = time.perf_counter()
        payload = ENCODER.encode(CoreBatch([], [], writer.write(current), None))
        t1 = time.perf_counter()
        core.send_multipart([identity, payload], copy=False)
        sent = time.perf_counter()
        front.poll()
        arrived = time.perf_counter()
        message = front.recv(copy=False)
        t2 = time.perf_counter()
        batch = EVENT_DECODER.decode(message.buffer)
        t3 = time.perf_counter()
        rebuilt = assembler.apply(batch.outputs)
        t4 = time.perf_counter()
        assert sorted(rebuilt, key=by_id) == sorted(current, key=by_id)
        for key, seconds in (
            ("encode", t1 - t0),
            ("send", sent - t1),
            ("in flight", arrived - sent),
            ("receive", t2 - arrived),
            ("decode", t3 - t2),
            ("rebuild", t4 - t3),
            ("core: encode+send", sent - t0),
            ("front: receive+decode", t3 - arrived),
            ("both ends: encode+send+receive+decode", sent - t0 + t3 - arrived),
            ("wall, send to decoded (in flight included)", t3 - t0),
        ):
            parts[key].append(seconds)
        size = len(payload)
    core.close(0)
    front.close(0)
    context.term()
    shutil.rmtree(directory)
    parts["bytes"] = [size]
    return parts


def describe(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"median {statistics.median(values) * 1e3:.3f} ms, p90 {p90 * 1e3:.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--decoded", type=int, default=64, help="tokens each has decoded")
    parser.add_argument("--logprobs", type=int, default=None, help="top logprobs per token")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--verbose", action="store_true", help="print every step's time")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    previous, current, requests, steps = run_engine(args)
    parts = time_transport(previous, current, requests, args.iters)
    print(
        f"{args.requests} running requests, {args.decoded} tokens decoded each, "
        f"logprobs={args.logprobs}; load {load:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print(f"engine step ({len(steps['step'])} decode steps): {describe(steps['step'])}")
    for key in ("detok", "stop"):
        share = sum(steps[key]) / sum(steps["step"])
        print(f"  of which {key}: {describe(steps[key])} ({share:.1%} of the step)")
    print(f"transport of one step's outputs ({parts.pop('bytes')[0]} bytes):")
    for key, values in parts.items():
        print(f"  {key}: {describe(values)}")


if __name__ == "__main__":
    main()
