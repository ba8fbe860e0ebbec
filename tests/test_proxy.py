"""``platform-core proxy`` (prefill/decode disaggregation, #23) before stub instances: what each
side gets, streams and whole answers passed through (the real ``openai`` client reads them),
refusals and failures, routing, instances out of rotation while unhealthy (the health poller,
a failed connection retried elsewhere), client disconnects, ``/health``, ``/metrics``, the API
key and the command line.

The stubs (``StubInstance``) are small FastAPI apps in threads that record every request and
answer as a prefill instance's connector would (``kv_transfer_params`` for a request with
``do_remote_decode``); what each answers is set per test through its ``state``. ``dropper()`` is
an instance that takes requests and drops them unanswered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socketserver
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families
from proxy_utils import live_app, live_proxy
from server_utils import expect_error, free_port, wait_for
from starlette.responses import Response

from platform_core.cli.main import build_parser
from platform_core.entrypoints.proxy.config import ProxyConfig
from platform_core.entrypoints.proxy.health import HealthChecker, record_health
from platform_core.entrypoints.proxy.routing import NoHealthyUpstream, UpstreamPool
from platform_core.errors import ConfigError

MODEL = "stub-model"
WORDS = ["Paris", " is", " the", " capital"]
DO_REMOTE_DECODE = {"do_remote_decode": True}
REMOTE_PREFILL = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_request_id": "cmpl-p-0",
    "remote_address": {"host": "127.0.0.1", "port": 14579},
    "remote_num_tokens": 5,
}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
ROUTES = [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]


@dataclass
class Received:
    path: str
    body: dict
    headers: dict[str, str]


@dataclass
class StubState:
    """How a stub answers (a fresh one per test) and what it has received.

    ``status``: generation requests get an error body with any other; ``delay``: seconds
    before answering them; ``params``: the ``kv_transfer_params`` of an answer to a
    ``do_remote_decode`` request; ``endless``: streams
    run until the client leaves (then ``closed`` is set); ``broken``: streams break off after
    their first event; ``health``: the status of ``/health``, after ``health_delay`` seconds.
    """

    received: list[Received] = field(default_factory=list)
    status: int = 200
    delay: float = 0.0
    health: int = 200
    health_delay: float = 0.0
    params: dict | None = field(default_factory=lambda: dict(REMOTE_PREFILL))
    endless: bool = False
    broken: bool = False
    closed: threading.Event = field(default_factory=threading.Event)


def _chunk(chat: bool, word: str, last: bool) -> dict:
    choice: dict = {"index": 0, "finish_reason": "length" if last else None}
    if chat:
        choice["delta"] = {"role": "assistant", "content": word}
    else:
        choice["text"] = word
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": "stub", "object": kind, "created": 1, "model": MODEL, "choices": [choice]}


def sse(chat: bool) -> bytes:
    """The server-sent events a stub streams: one chunk per word, then ``[DONE]``."""
    events = [_chunk(chat, w, i == len(WORDS) - 1) for i, w in enumerate(WORDS)]
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


def whole(chat: bool, params: dict | None) -> dict:
    """A stub's whole answer."""
    text = "".join(WORDS)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    return {
        "id": "stub",
        "object": "chat.completion" if chat else "text_completion",
        "created": 1,
        "model": MODEL,
        "choices": [{**choice, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
        "kv_transfer_params": params,
    }


class StubInstance:
    """A stand-in for a ``serve`` instance; ``state`` is what it answers and has received."""

    def __init__(self) -> None:
        self.state = StubState()
        self.url = ""
        self.app = FastAPI()
        self.app.post("/v1/completions")(self._generate)
        self.app.post("/v1/chat/completions")(self._generate)
        self.app.get("/health")(self._health)
        self.app.get("/v1/models")(self._models)

    async def _generate(self, request: Request) -> Response:
        state = self.state
        body = await request.json()
        state.received.append(Received(request.url.path, body, dict(request.headers)))
        await asyncio.sleep(state.delay)
        if state.status != 200:
            error = {"message": f"stub says {state.status}", "type": "x", "param": "prompt"}
            return JSONResponse({"error": error}, status_code=state.status)
        chat = request.url.path == "/v1/chat/completions"
        if body.get("stream"):
            return StreamingResponse(self._events(state, chat), media_type="text/event-stream")
        params = state.params if body.get("kv_transfer_params") == DO_REMOTE_DECODE else None
        return JSONResponse(whole(chat, params))

    async def _events(self, state: StubState, chat: bool) -> AsyncIterator[bytes]:
        try:
            if not (state.endless or state.broken):
                yield sse(chat)
                return
            first = sse(chat).split(b"\n\n")[0] + b"\n\n"
            yield first
            while state.endless:
                await asyncio.sleep(0.01)
                yield first
            raise RuntimeError("the stub breaks off its stream")
        finally:
            state.closed.set()

    async def _health(self) -> Response:
        await asyncio.sleep(self.state.health_delay)
        return Response(status_code=self.state.health)

    async def _models(self) -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "stub"}]}


class _DropHandler(socketserver.StreamRequestHandler):
    """Answers ``GET /health`` 200; reads any other request whole and closes without a word."""

    def handle(self) -> None:
        request_line = self.rfile.readline()
        length = 0
        while (line := self.rfile.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if request_line.startswith(b"GET /health "):
            self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            return
        self.rfile.read(length)
        self.server.dropped.append(request_line)  # type: ignore[attr-defined]


@contextmanager
def dropper() -> Iterator[tuple[str, list[bytes]]]:
    """An instance that is healthy but drops every request it gets: its URL and the request
    lines it dropped."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _DropHandler)
    server.daemon_threads = True
    server.dropped = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.dropped  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def served(instance: StubInstance) -> ExitStack:
    """Serve ``instance`` (setting its URL) until the stack returned is closed: from then on
    its port refuses connections."""
    stack = ExitStack()
    instance.url = stack.enter_context(live_app(instance.app))
    return stack


@pytest.fixture(scope="module")
def stubs() -> Iterator[dict[str, StubInstance]]:
    """Two prefill (``p1``, ``p2``) and two decode (``d1``, ``d2``) stand-ins."""
    instances = {name: StubInstance() for name in ("p1", "p2", "d1", "d2")}
    with ExitStack() as stack:
        for instance in instances.values():
            instance.url = stack.enter_context(live_app(instance.app))
        yield instances


@pytest.fixture(autouse=True)
def fresh(stubs: dict[str, StubInstance]) -> None:
    for instance in stubs.values():
        instance.state = StubState()


@pytest.fixture
def p1(stubs):
    return stubs["p1"]


@pytest.fixture
def d1(stubs):
    return stubs["d1"]


@pytest.fixture
def proxy(p1, d1) -> Iterator[str]:
    """A proxy before ``p1`` and ``d1``."""
    with live_proxy([p1.url], [d1.url]) as url:
        yield url


def down() -> str:
    """The URL of an instance that is not there (nothing listens on its port)."""
    return f"http://127.0.0.1:{free_port()}"


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """The proxy's samples: (name, sorted labels) -> value."""
    text = httpx.get(url + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _post(url: str, path: str, body: dict, timeout: float = 10, **kwargs) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout, **kwargs)


# ------------------------------------------------------------------------ what each side gets
@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_prefill_gets_one_token_and_decode_the_request_with_its_params(proxy, p1, d1, path, body):
    body = {**body, "n": 2, "min_tokens": 2, "best_of": 2, "temperature": 0.5}
    response = _post(proxy, path, body)
    assert response.status_code == 200, response.text
    assert response.json() == whole(path.endswith("chat/completions"), None)
    (prefill,) = p1.state.received
    expected = {k: v for k, v in body.items() if k not in ("min_tokens", "best_of")}
    expected |= {"max_tokens": 1, "n": 1, "stream": False, "kv_transfer_params": DO_REMOTE_DECODE}
    if path.endswith("chat/completions"):
        expected["max_completion_tokens"] = 1
    assert (prefill.path, prefill.body) == (path, expected)
    (decode,) = d1.state.received
    assert (decode.path, decode.body) == (path, {**body, "kv_transfer_params": REMOTE_PREFILL})


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_a_stream_passes_through_byte_for_byte(proxy, p1, d1, path, body):
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", proxy + path, json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        received = b"".join(response.iter_raw())
    assert received == sse(path.endswith("chat/completions"))
    (prefill,) = p1.state.received
    assert prefill.body["stream"] is False and "stream_options" not in prefill.body
    assert d1.state.received[0].body == {**body, "kv_transfer_params": REMOTE_PREFILL}


def test_the_openai_client_reads_answers_and_streams_through_the_proxy(proxy):
    client = openai.OpenAI(base_url=proxy + "/v1", api_key="key", max_retries=0)
    text = "".join(WORDS)
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8)
    assert completion.choices[0].text == text
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == text
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert chat.choices[0].message.content == text
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, stream=True
    )
    assert "".join(chunk.choices[0].delta.content for chunk in stream) == text
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_without_prefill_params_decode_gets_the_request_alone_logged_once(proxy, p1, d1, caplog):
    p1.state.params = None
    with caplog.at_level(logging.WARNING, logger="platform_core.proxy"):
        for _ in range(2):
            assert _post(proxy, "/v1/completions", COMPLETION).status_code == 200
    assert [r.body for r in d1.state.received] == [COMPLETION, COMPLETION]
    told = [r for r in caplog.records if "without kv_transfer_params" in r.getMessage()]
    assert len(told) == 1


def test_authorization_and_request_id_reach_both_sides(proxy, p1, d1):
    headers = {"authorization": "Bearer user-key", "x-request-id": "req-42"}
    assert _post(proxy, "/v1/completions", COMPLETION, headers=headers).status_code == 200
    for instance in (p1, d1):
        got = instance.state.received[0].headers
        assert (got["authorization"], got["x-request-id"]) == ("Bearer user-key", "req-42")


def test_the_proxys_own_key_guards_all_but_health_and_metrics(p1, d1):
    with live_proxy([p1.url], [d1.url], api_key="proxy-key") as url:
        refused = _post(url, "/v1/completions", COMPLETION)
        assert expect_error(refused, 401)["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models").status_code == 401
        assert not p1.state.received
        auth = {"authorization": "Bearer proxy-key"}
        assert _post(url, "/v1/completions", COMPLETION, headers=auth).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_a_body_that_is_no_json_object_is_a_400(proxy, p1, content):
    response = httpx.post(proxy + "/v1/completions", content=content, timeout=10)
    assert expect_error(response, 400)["type"] == "invalid_request_error"
    assert not p1.state.received


# ----------------------------------------------------------------------- refusals and failures
def test_a_prefill_refusal_goes_back_as_it_is_and_decode_is_not_asked(proxy, p1, d1):
    p1.state.status = 400
    response = _post(proxy, "/v1/completions", COMPLETION)
    assert expect_error(response, 400, "prompt")["message"] == "stub says 400"
    assert not d1.state.received


def test_a_decode_refusal_keeps_its_status(proxy, d1):
    d1.state.status = 404
    response = _post(proxy, "/v1/chat/completions", {**CHAT, "stream": True})
    assert expect_error(response, 404)["message"] == "stub says 404"


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("how", ["unreachable", "503"])
def test_a_failing_instance_is_a_502_naming_its_side(p1, d1, side, how):
    """``unreachable``: the side's only instance stops once the proxy has found it healthy."""
    gone = StubInstance()
    server = served(gone)
    urls = {"prefill": p1.url, "decode": d1.url}
    if how == "unreachable":
        urls[side] = gone.url
    else:
        (p1 if side == "prefill" else d1).state.status = 503
    with server, live_proxy([urls["prefill"]], [urls["decode"]]) as url:
        server.close()  # ``gone`` stops: its port refuses connections
        error = expect_error(_post(url, "/v1/completions", COMPLETION), 502)
        assert error["message"].startswith(f"the {side} instance {urls[side]} ")
        assert ("unreachable" if how == "unreachable" else "stub says 503") in error["message"]
        assert (error["type"], error["code"]) == ("server_error", f"{side}_unavailable")
        samples = metrics(url)
    errors = (
        "platform_core_proxy_upstream_errors_total",
        (("side", side), ("upstream", urls[side])),
    )
    assert samples[errors] == 1


def test_a_decode_stream_that_breaks_off_cuts_the_clients(proxy, d1):
    d1.state.broken = True
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", proxy + "/v1/completions", json={**COMPLETION, "stream": True}) as r,
    ):
        r.read()
    key = ("platform_core_proxy_upstream_errors_total", (("side", "decode"), ("upstream", d1.url)))
    wait_for(lambda: metrics(proxy).get(key) == 1, 5, "the broken stream was not counted")


# ------------------------------------------------------------------------------------- routing
def test_round_robin_takes_each_instance_in_turn(stubs):
    p1, p2, d1, d2 = (stubs[name] for name in ("p1", "p2", "d1", "d2"))
    with live_proxy([p1.url, p2.url], [d1.url, d2.url]) as url:
        for i in range(4):
            body = {**COMPLETION, "prompt": f"prompt {i}"}
            assert _post(url, "/v1/completions", body).status_code == 200
    for first, second in ((p1, p2), (d1, d2)):
        assert [r.body["prompt"] for r in first.state.received] == ["prompt 0", "prompt 2"]
        assert [r.body["prompt"] for r in second.state.received] == ["prompt 1", "prompt 3"]


def test_least_loaded_passes_over_an_instance_busy_with_a_stream(stubs):
    p1, d1, d2 = stubs["p1"], stubs["d1"], stubs["d2"]
    d1.state.endless = True
    body = {**COMPLETION, "stream": True}
    with (
        live_proxy([p1.url], [d1.url, d2.url], routing="least-loaded") as url,
        httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as held,
    ):
        chunks = held.iter_raw()  # kept: dropping the iterator would close the stream
        next(chunks)  # d1 is streaming (the first of a tie)
        for _ in range(2):
            assert _post(url, "/v1/completions", COMPLETION).status_code == 200
        in_flight = metrics(url)
    assert (len(d1.state.received), len(d2.state.received)) == (1, 2)
    gauge = "platform_core_proxy_upstream_in_flight"
    assert in_flight[(gauge, (("side", "decode"), ("upstream", d1.url)))] == 1
    assert in_flight[(gauge, (("side", "decode"), ("upstream", d2.url)))] == 0


def test_pool_policies_pick_in_turn_and_by_load():
    turns = UpstreamPool("decode", ["a", "b", "c"], "round-robin")
    assert [turns.acquire().url for _ in range(4)] == ["a", "b", "c", "a"]  # load is ignored
    pool = UpstreamPool("decode", ["a", "b", "c"], "least-loaded")
    a, b = pool.acquire(), pool.acquire()
    assert (a.url, b.url) == ("a", "b")
    pool.release(a)
    assert pool.acquire().url == "c"  # a and c are free: the tie goes in turn
    assert pool.acquire().url == "a"  # the only free one
    assert [u.in_flight for u in pool.upstreams] == [1, 1, 1]


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded"])
def test_pool_policies_pick_only_healthy_instances(policy):
    pool = UpstreamPool("prefill", ["a", "b", "c"], policy)
    pool.upstreams[1].healthy = False
    picked = [pool.acquire().url for _ in range(4)]
    assert picked == ["a", "c", "a", "c"]  # in turn among the healthy ones, b's share too
    for upstream in pool.upstreams:
        upstream.healthy = False
    with pytest.raises(NoHealthyUpstream, match="no prefill instance is healthy"):
        pool.acquire()


# ------------------------------------------------------------ instances out of rotation
def poll_once(checker: HealthChecker) -> None:
    asyncio.run(checker.check())


def test_polls_take_an_instance_out_after_two_failures_in_a_row_and_a_refusal_at_once():
    answers: dict[str, object] = {"a": 503, "b": 200}

    def handler(request: httpx.Request) -> httpx.Response:
        answer = answers[request.url.host]
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer)

    pool = UpstreamPool("decode", ["http://a", "http://b"], "round-robin")
    a, b = pool.upstreams
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    checker = HealthChecker(client, [pool], interval=1.0, timeout=1.0)
    poll_once(checker)
    assert (a.healthy, a.detail, b.healthy, b.detail) == (True, "HTTP 503", True, "HTTP 200")
    poll_once(checker)  # the second failure in a row
    assert (a.healthy, a.detail) == (False, "HTTP 503")
    answers["a"] = 200
    poll_once(checker)
    assert (a.healthy, a.failed_polls) == (True, 0)
    answers["a"] = RuntimeError("not an httpx error")  # the poller survives any failure
    poll_once(checker)
    poll_once(checker)
    assert (a.healthy, a.detail) == (False, "RuntimeError: not an httpx error")
    answers["b"] = httpx.ConnectError("refused")
    poll_once(checker)
    assert (b.healthy, b.detail) == (False, "ConnectError: refused")


def test_a_poll_answered_after_a_failed_connect_does_not_put_the_instance_back():
    pool = UpstreamPool("prefill", ["http://a"], "round-robin")
    (a,) = pool.upstreams

    def handler(request: httpx.Request) -> httpx.Response:
        record_health("prefill", a, False, "ConnectError")  # a request failed meanwhile
        return httpx.Response(200)

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    poll_once(HealthChecker(client, [pool], interval=1.0, timeout=1.0))
    assert (a.healthy, a.detail) == (False, "ConnectError")
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(200)))
    poll_once(HealthChecker(client, [pool], interval=1.0, timeout=1.0))
    assert (a.healthy, a.detail) == (True, "HTTP 200")


def healthy_gauge(url: str, side: str, upstream: str) -> float:
    """The proxy at ``url``'s ``upstream_healthy`` gauge for one instance."""
    labels = (("side", side), ("upstream", upstream))
    return metrics(url)[("platform_core_proxy_upstream_healthy", labels)]


def state_changes(caplog: pytest.LogCaptureFixture, url: str) -> list[str]:
    """The proxy's log lines about ``url``'s health changing."""
    return [
        r.getMessage()
        for r in caplog.records
        if url in r.getMessage()
        and ("became unhealthy" in r.getMessage() or "again" in r.getMessage())
    ]


@pytest.mark.parametrize("routing", ["round-robin", "least-loaded"])
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_instance_gone_down_leaves_the_rotation_and_its_request_goes_to_another(
    stubs, caplog, side, routing
):
    """The instance stops after the proxy found it healthy (and before a poll would find it
    gone): the first request that cannot connect to it marks it unhealthy and is sent to the
    other instance of its side; later ones go there directly."""
    gone, other = StubInstance(), stubs["p2" if side == "prefill" else "d2"]
    server = served(gone)
    urls = {"prefill": [stubs["p1"].url], "decode": [stubs["d1"].url], side: [gone.url, other.url]}
    with (
        caplog.at_level(logging.INFO, logger="platform_core.proxy"),
        server,
        live_proxy(urls["prefill"], urls["decode"], routing=routing, health_interval=600) as url,
    ):
        server.close()  # ``gone`` was first in turn
        for route, body in ROUTES * 2:
            response = _post(url, route, body)
            assert response.status_code == 200, response.text
        samples = metrics(url)
        assert httpx.get(url + "/health").json()[side][0]["detail"].startswith("ConnectError")
    assert len(other.state.received) == 4
    errors = ("platform_core_proxy_upstream_errors_total", (("side", side), ("upstream", gone.url)))
    assert samples[errors] == 1  # tried once, then out of rotation
    for instance, healthy in ((gone, 0), (other, 1)):
        labels = (("side", side), ("upstream", instance.url))
        assert samples[("platform_core_proxy_upstream_healthy", labels)] == healthy
    (change,) = state_changes(caplog, gone.url)
    assert f"the {side} instance {gone.url} became unhealthy: ConnectError" in change


@pytest.mark.parametrize("how", ["503", "timeout"])
def test_the_health_poller_takes_an_instance_out_and_back(stubs, caplog, how):
    p1, d1, d2 = stubs["p1"], stubs["d1"], stubs["d2"]
    with (
        caplog.at_level(logging.INFO, logger="platform_core.proxy"),
        live_proxy([p1.url], [d1.url, d2.url], health_interval=0.05, health_timeout=0.2) as url,
    ):
        assert healthy_gauge(url, "decode", d1.url) == 1
        if how == "503":
            d1.state.health = 503
        else:
            d1.state.health_delay = 2.0
        wait_for(lambda: healthy_gauge(url, "decode", d1.url) == 0, 10, "d1 stayed in rotation")
        d1_health = httpx.get(url + "/health").json()["decode"][0]
        assert d1_health["healthy"] is False
        assert d1_health["detail"] == ("HTTP 503" if how == "503" else "ReadTimeout")
        for _ in range(3):
            assert _post(url, "/v1/completions", COMPLETION).status_code == 200
        assert (len(d1.state.received), len(d2.state.received)) == (0, 3)
        d1.state.health, d1.state.health_delay = 200, 0.0
        wait_for(lambda: healthy_gauge(url, "decode", d1.url) == 1, 10, "d1 did not come back")
        for _ in range(2):
            assert _post(url, "/v1/completions", COMPLETION).status_code == 200
        assert (len(d1.state.received), len(d2.state.received)) == (1, 4)
    unhealthy, back = state_changes(caplog, d1.url)  # once per change, not once per poll
    assert f"the decode instance {d1.url} became unhealthy: " in unhealthy
    assert f"the decode instance {d1.url} is healthy again (HTTP 200)" in back


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_side_without_a_healthy_instance_is_a_503_naming_it(p1, d1, side):
    urls = {"prefill": [p1.url], "decode": [d1.url], side: [down(), down()]}
    with live_proxy(urls["prefill"], urls["decode"]) as url:
        for route, body in ROUTES:
            error = expect_error(_post(url, route, body), 503)
            assert error["message"] == f"no {side} instance is healthy"
            assert (error["type"], error["code"]) == (
                "service_unavailable_error",
                f"no_healthy_{side}",
            )
        models = httpx.get(url + "/v1/models")
        assert models.status_code == (503 if side == "decode" else 200)
        assert httpx.get(url + "/health").status_code == 503
        assert [healthy_gauge(url, side, upstream) for upstream in urls[side]] == [0, 0]
        samples = metrics(url)
    assert not p1.state.received and not d1.state.received  # no prefill without a decode side
    for route, _ in ROUTES:
        outcome = (("endpoint", route), ("outcome", "unavailable"))
        assert samples[("platform_core_proxy_requests_total", outcome)] == 1


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_request_an_instance_got_is_never_sent_to_another(stubs, side):
    """The instance reads the request and closes the connection unanswered: it may have run
    it, so the client gets a 502 and the other instance of the side nothing."""
    other = stubs["p2" if side == "prefill" else "d2"]
    with dropper() as (dropping, dropped):
        urls = {
            "prefill": [stubs["p1"].url],
            "decode": [stubs["d1"].url],
            side: [dropping, other.url],
        }
        with live_proxy(urls["prefill"], urls["decode"]) as url:
            error = expect_error(_post(url, "/v1/completions", COMPLETION), 502)
            assert error["message"].startswith(f"the {side} instance {dropping} failed mid-request")
            assert error["code"] == f"{side}_unavailable"
            assert healthy_gauge(url, side, dropping) == 1  # it took the request: not "down"
    assert dropped == [b"POST /v1/completions HTTP/1.1\r\n"]
    assert not other.state.received
    assert len(stubs["p1"].state.received) == (1 if side == "decode" else 0)


# ----------------------------------------------------------------------------- disconnects
def test_a_client_that_leaves_mid_stream_closes_the_decode_stream(proxy, d1):
    d1.state.endless = True
    body = {**CHAT, "stream": True}
    with httpx.stream("POST", proxy + "/v1/chat/completions", json=body, timeout=10) as response:
        assert next(response.iter_raw()).startswith(b"data: ")
    assert d1.state.closed.wait(5), "the decode instance's stream was left open"
    gauge = ("platform_core_proxy_upstream_in_flight", (("side", "decode"), ("upstream", d1.url)))
    left = (
        "platform_core_proxy_requests_total",
        (("endpoint", "/v1/chat/completions"), ("outcome", "disconnected")),
    )
    wait_for(lambda: metrics(proxy)[left] == 1, 5, "the disconnect was not counted")
    assert metrics(proxy)[gauge] == 0


def test_a_client_that_leaves_during_the_prefill_is_not_decoded(proxy, p1, d1):
    p1.state.delay = 0.5
    with pytest.raises(httpx.ReadTimeout):
        _post(proxy, "/v1/completions", COMPLETION, timeout=0.1)
    left = (
        "platform_core_proxy_requests_total",
        (("endpoint", "/v1/completions"), ("outcome", "disconnected")),
    )
    wait_for(lambda: metrics(proxy).get(left) == 1, 5, "the disconnect was not counted")
    assert len(p1.state.received) == 1 and not d1.state.received


# ------------------------------------------------------------------------- health and metrics
def test_health_is_200_while_each_side_has_a_healthy_instance(p1, d1):
    gone = down()
    with live_proxy([gone, p1.url], [d1.url], health_interval=0.05) as url:
        response = httpx.get(url + "/health")
        assert response.status_code == 200, response.text
        report = response.json()
        assert report["status"] == "ok"
        assert report["decode"] == [{"url": d1.url, "healthy": True, "detail": "HTTP 200"}]
        unreachable, healthy = report["prefill"]
        assert (unreachable["url"], unreachable["healthy"]) == (gone, False)
        assert unreachable["detail"].startswith("ConnectError")
        assert healthy == {"url": p1.url, "healthy": True, "detail": "HTTP 200"}
        d1.state.health = 503
        wait_for(lambda: httpx.get(url + "/health").status_code == 503, 5, "still healthy")
        response = httpx.get(url + "/health")
        assert response.json()["status"] == "unavailable"
        assert response.json()["decode"][0] == {
            "url": d1.url,
            "healthy": False,
            "detail": "HTTP 503",
        }


def test_metrics_count_requests_by_outcome_and_time_both_sides(proxy, p1):
    for _ in range(2):
        assert _post(proxy, "/v1/completions", COMPLETION).status_code == 200
    p1.state.status = 400
    assert _post(proxy, "/v1/completions", COMPLETION).status_code == 400
    assert _post(proxy, "/v1/chat/completions", {**CHAT, "stream": True}).status_code == 400
    samples = metrics(proxy)

    def requests(endpoint: str, outcome: str) -> float:
        labels = (("endpoint", endpoint), ("outcome", outcome))
        return samples[("platform_core_proxy_requests_total", labels)]

    assert requests("/v1/completions", "success") == 2
    assert requests("/v1/completions", "client_error") == 1
    assert requests("/v1/chat/completions", "client_error") == 1
    assert samples[("platform_core_proxy_prefill_latency_seconds_count", ())] == 4
    assert samples[("platform_core_proxy_decode_time_to_first_byte_seconds_count", ())] == 2
    assert samples[("platform_core_proxy_decode_time_to_first_byte_seconds_sum", ())] > 0


# ------------------------------------------------------------------ the command and its module
# ``platform-core proxy`` without the main command's imports (torch: seconds to start); that
# ``main`` registers it is checked with its parser below.
PROXY = """
import argparse, sys
from platform_core.cli.proxy import add_proxy_parser
parser = argparse.ArgumentParser()
add_proxy_parser(parser.add_subparsers())
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def test_the_proxy_command_serves(p1, d1):
    port = free_port()
    command = [sys.executable, "-c", PROXY, "proxy", "--prefill", p1.url]
    command += ["--decode", d1.url, down(), "--port", str(port), "--health-interval", "0.5"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:

        def healthy() -> bool:
            assert process.poll() is None, process.stderr.read()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, 20, "the proxy did not start")
        url = f"http://127.0.0.1:{port}"
        assert _post(url, "/v1/completions", COMPLETION).json()["choices"][0]["text"]
    finally:
        process.terminate()
        process.wait(10)


def test_the_command_line_and_config_are_checked():
    args = build_parser().parse_args(
        ["proxy", "--prefill", "http://p:1/", "--decode", "http://d:1", "https://d:2"]
    )
    assert args.func.__module__ == "platform_core.cli.proxy"
    assert (args.prefill, args.decode, args.routing) == (
        ["http://p:1/"],
        ["http://d:1", "https://d:2"],
        "round-robin",
    )
    assert (args.health_interval, args.health_timeout) == (5.0, 2.0)
    assert ProxyConfig(("http://p:1/",), ("http://d:1",)).prefill == ("http://p:1",)
    for bad in (
        {"prefill": ()},
        {"decode": ("d:1",)},
        {"decode": ("http://d:port",)},
        {"decode": ("http://d:70000",)},
        {"prefill": ("http://",)},
        {"routing": "random"},
        {"api_key": " "},
        {"connect_timeout": 0},
        {"health_interval": 0},
        {"health_timeout": -1},
    ):
        with pytest.raises(ConfigError):
            ProxyConfig(**{"prefill": ("http://p:1",), "decode": ("http://d:1",), **bad})


def test_the_proxy_imports_neither_the_engine_nor_torch():
    code = (
        "import sys; import platform_core.cli.proxy, platform_core.entrypoints.proxy.app; "
        "print(sorted(m for m in sys.modules if m.startswith(('platform_core.engine', 'torch'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
