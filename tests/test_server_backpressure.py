"""A client that stops reading its stream: once its choices lag by ``--max-stream-buffer-tokens``
the server aborts its requests (freeing their KV blocks) and the stream ends with an error event
then ``[DONE]``; a client that reads is never cut by the same limit."""

from __future__ import annotations

import json
import socket

import httpx
from server_utils import MODEL_NAME, assert_engine_clean, engine_idle, live_server, wait_for

from platform_core.entrypoints.openai.limits import RequestLimits

# Far below the 200 tokens a choice streams, so a stalled client is cut; with room for a reader
# that a busy 2-core machine deschedules for a few steps (at 8, one CI run's reader got 184 of
# 800 tokens).
PER_CHOICE_LIMIT = 32
# Room in the kernel's buffers on both ends: small, so the server's writes stall soon.
SOCKET_BUFFER_BYTES = 4096
BODY = {
    "model": MODEL_NAME,
    "prompt": "A client that does not read",
    "max_tokens": 200,
    "ignore_eos": True,
    "n": 4,
    "logprobs": 5,
    "stream": True,
}


def sse_events(raw: bytes) -> list[str]:
    """The ``data:`` payloads of a raw chunked HTTP response, in order."""
    text = raw.decode("utf-8", "replace")
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def tokens_sent(events: list[str]) -> int:
    """Output tokens the stream's chunks carried (each choice's logprobs name its tokens)."""
    total = 0
    for event in events:
        if event.startswith("{"):
            for choice in json.loads(event).get("choices", []):
                total += len((choice.get("logprobs") or {}).get("tokens", []))
    return total


def test_a_client_that_stops_reading_is_aborted_and_its_blocks_freed(engine, probe):
    limits = RequestLimits(max_stream_buffer_tokens=PER_CHOICE_LIMIT)
    with live_server(engine, limits=limits, send_buffer_bytes=SOCKET_BUFFER_BYTES) as url:
        port = int(url.rsplit(":", 1)[1])
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        client.connect(("127.0.0.1", port))
        body = json.dumps(BODY).encode()
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # Not reading: the server's writes stall, the engine's outputs pile up, and the limit
        # aborts the requests while this socket is still open.
        wait_for(lambda: engine.stats()["num_running"] > 0, 30, "the request never ran")
        wait_for(lambda: engine_idle(engine), 60, f"the stalled stream was kept: {engine.stats()}")
        client.settimeout(30)
        raw = b""
        while not raw.endswith(b"0\r\n\r\n"):  # the chunked body's end
            chunk = client.recv(1 << 16)
            if not chunk:
                break
            raw += chunk
        client.close()
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "did not read its stream" in error["message"], error
    assert tokens_sent(events) < BODY["n"] * BODY["max_tokens"], "the stream was not cut"
    assert_engine_clean(engine, probe)


def test_a_client_that_reads_is_never_cut_by_the_same_limit(engine):
    limits = RequestLimits(max_stream_buffer_tokens=PER_CHOICE_LIMIT)
    with (
        live_server(engine, limits=limits, send_buffer_bytes=SOCKET_BUFFER_BYTES) as url,
        httpx.stream("POST", url + "/v1/completions", json=BODY, timeout=60) as response,
    ):
        events = [
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
        ]
    assert events[-1] == "[DONE]"
    assert not any('"error"' in e for e in events), events[-2]  # cut: says why first
    assert tokens_sent(events) == BODY["n"] * BODY["max_tokens"]
    wait_for(lambda: engine_idle(engine), 30, f"blocks leaked: {engine.stats()}")


def test_a_stream_ended_for_backpressure_sends_an_error_event_then_done():
    import asyncio

    from platform_core.entrypoints.openai.response_bodies import (
        CompletionChoice,
        CompletionResponse,
    )
    from platform_core.entrypoints.openai.responses import event_stream
    from platform_core.errors import StreamBackpressureError

    async def chunks():
        yield CompletionResponse(
            id="c", created=0, model="m", choices=[CompletionChoice(index=0, text="a")]
        )
        raise StreamBackpressureError("the client stopped reading for 30 s")

    async def body() -> list[str]:
        return [part async for part in event_stream(chunks()).body_iterator]

    events = asyncio.run(body())
    assert len(events) == 3 and events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert "stopped reading" in error["message"] and error["code"] == "request_failed"
