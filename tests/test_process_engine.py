"""Process mode (issue #26): an engine core in its own process gives the outputs of the
in-thread engine, carries typed errors back, frees the blocks of aborted requests, fails to
start with the child's own error, serves several clients over tcp behind a shared secret,
runs data-parallel replicas, and shuts down cleanly."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
from pathlib import Path

import pytest
import zmq
from engine_probe import EngineProbe
from process_tree import state, zombies_below
from server_utils import engine_config, engine_idle, wait_for
from text_model import save_text_model

from platform_core.engine.async_engine import AsyncEngine
from platform_core.engine.core_auth import ROLE_ENGINE, Nonces, check_proof, new_nonce
from platform_core.engine.core_client import CoreClient
from platform_core.engine.core_messages import (
    ENCODER,
    HANDSHAKE_DECODER,
    PEER_SILENCE_S,
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    Refused,
)
from platform_core.engine.core_process import CoreAddresses
from platform_core.engine.launch import start_engine
from platform_core.engine.process_engine import ProcessEngine
from platform_core.engine.request_stream import GenerateRequest
from platform_core.errors import (
    ConfigError,
    EngineConnectionError,
    EngineDeadError,
    InvalidRequestError,
)
from platform_core.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
PROMPTS = [[5 + i, 40, 17 + 3 * i, 99, 12] for i in range(8)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_text_model(tmp_path_factory.mktemp("process-engine-model"))


@pytest.fixture(scope="module")
def engines(model_dir):
    """The same model in an engine-core process and on a thread."""
    process = ProcessEngine.from_config(engine_config(model_dir))
    thread = AsyncEngine.from_config(engine_config(model_dir))
    yield process, thread
    process.shutdown()
    thread.shutdown()


async def _stream(engine, request_id, prompt, params, prompt_ids=None):
    return [o async for o in engine.generate(request_id, prompt, params, prompt_ids)]


def _timeless(output):
    return dataclasses.replace(output, metrics=None)


def test_outputs_are_those_of_the_in_thread_engine(engines):
    process, thread = engines
    (probe,) = asyncio.run(_stream(thread, "probe", "The capital of", SAMPLED))[-1:]
    text = probe.outputs[0].text
    assert len(text) >= 6, text
    cases = {
        "greedy": ("The capital of", GREEDY, None),
        "ids": (None, GREEDY, [5, 40, 17, 99]),
        "n3": ("Rome", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8), None),
        "logprobs": (
            "A paged",
            SamplingParams(max_tokens=9, logprobs=3, prompt_logprobs=2, seed=1),
            None,
        ),
        "stop": ("The capital of", dataclasses.replace(SAMPLED, stop=[text[3:5]]), None),
    }
    for name, (prompt, params, ids) in cases.items():
        want = asyncio.run(_stream(thread, f"t-{name}", prompt, params, ids))
        got = asyncio.run(_stream(process, f"t-{name}", prompt, params, ids))
        assert _timeless(got[-1]) == _timeless(want[-1]), name
        final = got[-1]
        # Streamed outputs grow towards the final one (a slow reader sees fewer of them).
        for early in got[:-1]:
            assert not early.finished
            for part, whole in zip(early.outputs, final.outputs):
                assert whole.token_ids[: len(part.token_ids)] == part.token_ids
                assert whole.text.startswith(part.text)
                if part.logprobs is not None:
                    assert whole.logprobs[: len(part.logprobs)] == part.logprobs
    assert final.outputs[0].finish_reason == "stop"
    assert engine_idle(process)


def test_a_concurrent_batch_matches_the_in_thread_engine(engines):
    process, thread = engines

    async def batch(engine):
        outs = await asyncio.gather(
            *(_stream(engine, f"b-{i}", None, GREEDY, p) for i, p in enumerate(PROMPTS))
        )
        return [_timeless(o[-1]) for o in outs]

    before = process.stats()["num_steps"]
    assert asyncio.run(batch(process)) == asyncio.run(batch(thread))
    after = process.stats()
    assert after["num_steps"] - before < len(PROMPTS) * GREEDY.max_tokens / 2  # batched
    wait_for(lambda: engine_idle(process), 10, f"blocks kept: {process.stats()}")


def test_leaving_a_stream_aborts_it_in_the_core_and_frees_its_blocks(engines):
    process, _ = engines
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def leave_early():
        outputs = process.generate("early", None, long, PROMPTS[1] * 4)
        first = await anext(outputs)
        await outputs.aclose()
        return first

    assert not asyncio.run(leave_early()).finished
    wait_for(lambda: engine_idle(process), 10, f"the aborted request kept: {process.stats()}")
    assert process.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize(
    "params, prompt",
    [(GREEDY, [10**6]), (SamplingParams(stop_token_ids=[10**6]), [5, 6]), (GREEDY, [])],
)
def test_an_invalid_request_raises_the_same_typed_error(engines, params, prompt):
    errors = []
    for engine in engines:
        with pytest.raises(InvalidRequestError) as caught:
            asyncio.run(_stream(engine, "bad", None, params, prompt))
        errors.append((str(caught.value), caught.value.param))
    assert errors[0] == errors[1] and errors[0][1] is not None


def test_a_group_with_an_invalid_request_is_refused_whole(engines):
    process, _ = engines

    async def submit():
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        await process.submit(
            [
                GenerateRequest("g-ok", None, long, [5, 6, 7]),
                GenerateRequest("g-bad", None, long, []),
            ]
        )

    with pytest.raises(InvalidRequestError):
        asyncio.run(submit())
    wait_for(lambda: engine_idle(process), 10, "the valid half of a refused group kept running")


@pytest.mark.parametrize(
    "keys",
    [{"max_model_len": 100_000}, {"kv_cache_memory_bytes": 1}],
    ids=["context-too-long", "no-room-for-the-kv-cache"],
)
def test_a_failure_to_start_is_the_cores_own_typed_error(model_dir, keys):
    config = engine_config(model_dir, **keys)
    with pytest.raises(Exception) as in_thread:
        AsyncEngine.from_config(config)
    with pytest.raises(type(in_thread.value)) as in_process:
        ProcessEngine.from_config(config)
    assert str(in_process.value) == str(in_thread.value)
    assert isinstance(in_process.value, ConfigError)
    assert not zombies_below(os.getpid())


def test_a_missing_model_fails_with_the_same_error(tmp_path):
    config = engine_config(tmp_path / "no-such-model")
    with pytest.raises(Exception) as in_thread:
        AsyncEngine.from_config(config)
    with pytest.raises(type(in_thread.value), match="no-such-model"):
        ProcessEngine.from_config(config)


def test_shutdown_fails_requests_in_flight_and_the_core_exits(model_dir):
    engine = ProcessEngine.from_config(engine_config(model_dir))
    pid, directory = engine.pid, Path(engine._private_dir)
    assert directory.is_dir()

    async def run():
        outputs = engine.generate("in-flight", None, SamplingParams(max_tokens=240), PROMPTS[3])
        await anext(outputs)
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in outputs:
                pass
        with pytest.raises(EngineDeadError):
            await engine.submit([GenerateRequest("late", None, GREEDY, [5])])

    asyncio.run(run())
    assert not engine.is_running and engine.error is None
    assert engine._process.returncode == 0
    assert state(pid) is None, "the core was not reaped"
    assert not directory.exists()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _raw_hello(address: str, hello: Hello):
    """A bare ZMQ client's handshake: the core's answer."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(ENCODER.encode(hello))
        assert sock.poll(30_000), "the core did not answer"
        return HANDSHAKE_DECODER.decode(sock.recv())
    finally:
        sock.close()
        context.term()


def test_tcp_with_a_shared_secret_serves_several_clients_and_refuses_others(model_dir):
    ports = _free_port(), _free_port()
    addresses = CoreAddresses(*(f"tcp://127.0.0.1:{port}" for port in ports))
    owner = ProcessEngine(engine_config(model_dir), addresses=addresses, secret=b"s3cret")
    try:
        other = CoreClient(addresses, secret=b"s3cret")  # a second front on the same core
        assert other.max_model_len == owner.max_model_len

        async def both():
            return await asyncio.gather(
                _stream(owner, "from-owner", None, GREEDY, PROMPTS[0]),
                _stream(other, "from-other", None, GREEDY, PROMPTS[0]),
            )

        mine, theirs = asyncio.run(both())
        assert mine[-1].outputs[0].token_ids == theirs[-1].outputs[0].token_ids
        assert len(theirs[-1].outputs[0].token_ids) == GREEDY.max_tokens
        with pytest.raises(EngineConnectionError, match="secret"):
            CoreClient(addresses, secret=b"wrong")
        with pytest.raises(EngineConnectionError, match="secret"):
            CoreClient(addresses)
        refused = _raw_hello(addresses.events, Hello(PROTOCOL_VERSION + 1, "future", new_nonce()))
        assert isinstance(refused, Refused)
        assert f"protocol version {PROTOCOL_VERSION + 1}" in refused.reason
        assert f"version {PROTOCOL_VERSION}" in refused.reason
        nonce = new_nonce()
        challenge = _raw_hello(addresses.events, Hello(PROTOCOL_VERSION, "bare", nonce))
        assert isinstance(challenge, Challenge)  # the core proves the secret first
        nonces = Nonces(nonce, challenge.nonce)
        check_proof(b"s3cret", ROLE_ENGINE, nonces, challenge.proof, "the core")
    finally:
        owner.shutdown()
    wait_for(lambda: not other.is_running, 10, "the second client did not hear the core stop")


def test_data_parallel_replicas_are_engine_core_processes(model_dir):
    config = engine_config(model_dir, data_parallel_size=2)
    front = start_engine(config, "process")
    try:
        pids = {replica.pid for replica in front.replicas}
        assert len(pids) == 2 and all(isinstance(r, ProcessEngine) for r in front.replicas)

        async def run():
            return await asyncio.gather(
                *(_stream(front, f"dp-{i}", None, GREEDY, p) for i, p in enumerate(PROMPTS))
            )

        outputs = asyncio.run(run())
        assert all(len(o[-1].outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)
        assert min(front.routed) >= 2, front.routed
        assert all(r.stats()["num_steps"] > 0 for r in front.replicas)
        assert front.eos_token_ids == front.replicas[0].eos_token_ids
    finally:
        front.shutdown()
    assert all(state(pid) is None for pid in pids)


def test_a_step_longer_than_the_silence_limit_is_not_a_dead_core(model_dir, tmp_path):
    """The core heartbeats from a thread of its own: a step that outlasts ``PEER_SILENCE_S``
    (a long prefill on a slow CPU) does not read as a dead core to its front."""
    probe = EngineProbe(tmp_path)
    engine = ProcessEngine.from_config(engine_config(model_dir), engine_setup=probe.install)
    try:
        probe.once = PEER_SILENCE_S + 2
        outputs = asyncio.run(_stream(engine, "slow-step", None, GREEDY, PROMPTS[0]))
        assert outputs[-1].finished and outputs[-1].error is None
        assert engine.is_running, engine.error
    finally:
        engine.shutdown()
