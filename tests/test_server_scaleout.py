"""``serve --api-server-count N``: several API servers on one port, one engine core; the HMAC
handshake between fronts and engine cores."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
from process_tree import cmdline, descendants, state
from server_utils import engine_config, launch_serve, live_server, start_test_engine, wait_for

from platform_core.engine.core_auth import (
    ROLE_ENGINE,
    ROLE_FRONT,
    EngineAuthenticationError,
    Nonces,
    check_proof,
    load_engine_secret,
    new_nonce,
    prove,
)
from platform_core.engine.core_client import CoreClient
from platform_core.engine.core_messages import (
    ENCODER,
    HANDSHAKE_DECODER,
    PROTOCOL_VERSION,
    Hello,
    Proof,
    Refused,
)
from platform_core.engine.process_engine import ProcessEngine
from platform_core.errors import ConfigError

PROMPTS = ["The capital of", "Once upon a time", "One two three", "Hello there"]


def _greedy(url: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")


def _connections(pid: int, port: int) -> int:
    """Established TCP connections to local ``port`` that process ``pid`` holds."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                inodes.add(fields[9])
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().name
        except OSError:
            continue
        held += target.startswith("socket:[") and target[8:-1] in inodes
    return held


@pytest.fixture(scope="module")
def scaled(model_dir, tmp_path_factory):
    served = launch_serve(
        model_dir, tmp_path_factory.mktemp("logs") / "scaled.log", "--api-server-count", "3"
    )
    try:
        wait_for(served.healthy, 240, "the supervised server did not become healthy")
        yield served
    finally:
        served.stop()


def test_several_api_servers_answer_concurrently_like_one_server(scaled, model_dir):
    results: dict[int, str] = {}

    def ask(i: int) -> None:
        results[i] = _greedy(scaled.url, PROMPTS[i % len(PROMPTS)])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    engine = start_test_engine(engine_config(model_dir), mode="thread")
    try:
        with live_server(engine) as single:
            expected = [_greedy(single, prompt) for prompt in PROMPTS]
    finally:
        engine.shutdown()
    assert [results[i] for i in range(12)] == expected * 3
    # Per-request counters are summed over the API servers: 12 requests x 12 tokens.
    assert _metric(scaled.url, "platform_core_generation_tokens_total") >= 144


def test_a_killed_api_server_loses_only_its_streams_and_frees_their_blocks(scaled):
    port = int(scaled.url.rsplit(":", 1)[1])
    workers = [p for p in descendants(scaled.process.pid) if "api_worker" in cmdline(p)]
    assert len(workers) == 3
    outcomes: list[str] = []
    streaming = threading.Semaphore(0)

    def stream() -> None:
        body = {"prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", scaled.url + "/v1/completions", json=body, timeout=120) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n == 0:
                        streaming.release()
            outcomes.append("done")
        except httpx.TransportError:
            outcomes.append("error")

    threads = [threading.Thread(target=stream) for _ in range(6)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert streaming.acquire(timeout=120)
    held = {pid: _connections(pid, port) for pid in workers}
    victim = max(held, key=held.get)
    assert sum(held.values()) == 6 and held[victim] > 0, held
    os.kill(victim, signal.SIGKILL)
    for thread in threads:
        thread.join(300)
    assert sorted(outcomes) == ["done"] * (6 - held[victim]) + ["error"] * held[victim]
    # The others serve on; the core aborted the dead server's requests (heartbeats).
    wait_for(lambda: state(victim) is None, 30, "the killed API server was not reaped")
    assert _greedy(scaled.url, "One two three")
    wait_for(
        lambda: (
            _metric(scaled.url, "platform_core_kv_cache_usage_perc") == 0.0
            and _metric(scaled.url, "platform_core_num_requests_running") == 0.0
        ),
        60,
        "the dead API server's requests still hold KV blocks",
    )


def test_sigterm_stops_every_process_of_the_supervised_server(scaled):
    tree = descendants(scaled.process.pid)
    assert len(tree) >= 3
    scaled.process.send_signal(signal.SIGTERM)
    assert scaled.process.wait(120) == 0
    wait_for(lambda: all(state(p) in (None, "Z") for p in tree), 60, "processes outlived serve")
    assert all(state(p) is None for p in tree), "zombies left"


# ---------------------------------------------------------------------------- the handshake
def test_proofs_bind_the_secret_the_role_and_both_nonces():
    nonces = Nonces(new_nonce(), new_nonce())
    proof = prove(b"s3cret", ROLE_FRONT, nonces)
    check_proof(b"s3cret", ROLE_FRONT, nonces, proof, "peer")
    bad = [
        (b"other", ROLE_FRONT, nonces),
        (b"s3cret", ROLE_ENGINE, nonces),  # reflected back as the other role
        (b"s3cret", ROLE_FRONT, Nonces(nonces.front, new_nonce())),  # replayed
    ]
    for secret, role, other in bad:
        with pytest.raises(EngineAuthenticationError, match="does not know"):
            check_proof(secret, role, other, proof, "peer")
    with pytest.raises(EngineAuthenticationError, match="has no shared engine secret"):
        check_proof(b"s3cret", ROLE_FRONT, nonces, None, "peer")
    with pytest.raises(EngineAuthenticationError, match="this side has none"):
        check_proof(None, ROLE_FRONT, nonces, proof, "peer")


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("PLATFORM_CORE_ENGINE_SECRET", raising=False)
    assert load_engine_secret(None) is None
    (tmp_path / "secret").write_text("abc\n")
    assert load_engine_secret(str(tmp_path / "secret")) == b"abc"
    monkeypatch.setenv("PLATFORM_CORE_ENGINE_SECRET", "xyz")
    assert load_engine_secret(None) == b"xyz"
    (tmp_path / "empty").write_text(" \n")
    with pytest.raises(ConfigError, match="empty"):
        load_engine_secret(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_engine_secret(str(tmp_path / "missing"))


def test_fronts_and_engine_cores_refuse_each_other_without_the_secret(model_dir):
    import zmq

    core = ProcessEngine(engine_config(model_dir), secret=b"right")
    try:
        with pytest.raises(EngineAuthenticationError, match="does not know the shared"):
            CoreClient(core.addresses, secret=b"wrong")  # the front refuses the engine
        with pytest.raises(EngineAuthenticationError, match="this side has none"):
            CoreClient(core.addresses)
        # A front that cannot prove the secret is refused by the engine core.
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.connect(core.addresses.events)
        sock.send(ENCODER.encode(Hello(PROTOCOL_VERSION, "impostor", new_nonce())))
        assert sock.poll(30_000)
        HANDSHAKE_DECODER.decode(sock.recv())
        sock.send(ENCODER.encode(Proof(b"x" * 32)))
        assert sock.poll(30_000)
        refused = HANDSHAKE_DECODER.decode(sock.recv())
        assert isinstance(refused, Refused) and "does not know" in refused.reason
        sock.close(0)
        context.term()
        good = CoreClient(core.addresses, core.tokenizer, b"right", stop_core_on_shutdown=False)
        assert good.stats()["kv_blocks_used"] == 0
        good.shutdown()
    finally:
        core.shutdown()
    open_core = ProcessEngine(engine_config(model_dir))
    try:
        with pytest.raises(EngineAuthenticationError, match="has no shared engine secret"):
            CoreClient(open_core.addresses, secret=b"right")
    finally:
        open_core.shutdown()
