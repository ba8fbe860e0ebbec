"""The engine-core protocol (issue #26): every message round-trips through msgspec, sampling
params come back exactly (derived fields included) and errors keep their type. That step deltas
rebuild the engine's outputs is ``test_output_deltas``."""

from __future__ import annotations

import dataclasses
import time

import msgspec
import pytest

from platform_core.engine.core_messages import (
    COMMAND_DECODER,
    ENCODER,
    EVENT_DECODER,
    HANDSHAKE_DECODER,
    HELLO_DECODER,
    PROTOCOL_VERSION,
    Abort,
    Challenge,
    CompletionDelta,
    CoreBatch,
    CoreStopped,
    Detach,
    ErrorInfo,
    Heartbeat,
    Hello,
    Proof,
    Ready,
    Refused,
    Rejection,
    RequestDelta,
    Shutdown,
    StepDeltas,
    Submit,
    WireSamplingParams,
    error_from,
    error_info,
    params_from_wire,
    params_to_wire,
    request_from_wire,
    request_to_wire,
)
from platform_core.engine.outputs import Logprob, RequestMetrics
from platform_core.engine.request_stream import GenerateRequest
from platform_core.errors import (
    ConfigError,
    InvalidRequestError,
    QueueFullError,
    UnsupportedByBackendError,
)
from platform_core.sampling_params import SamplingParams

EVERY_FIELD = SamplingParams(
    n=3,
    temperature=0.7,
    top_p=0.9,
    top_k=0,  # normalized to -1 by __post_init__
    min_p=0.05,
    seed=-(2**62),
    max_tokens=40,
    min_tokens=2,
    stop=["\n\n", "END"],
    stop_token_ids=[7, 3, 7, 9],  # duplicates dropped by __post_init__
    include_stop_str_in_output=True,
    ignore_eos=True,
    logprobs=4,
    prompt_logprobs=2,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.3,
    logit_bias={5: -1.5, 11: 2.0},
    allowed_token_ids=[3, 5, 5, 7, 9, 11],
    skip_special_tokens=False,
    detokenize=True,
)
DERIVED = [f.name for f in dataclasses.fields(SamplingParams) if not f.init]
PARAMS_DECODER = msgspec.msgpack.Decoder(WireSamplingParams)


def through_the_wire(message, decoder):
    return decoder.decode(ENCODER.encode(message))


def test_sampling_params_with_every_field_set_come_back_exactly():
    back = params_from_wire(through_the_wire(params_to_wire(EVERY_FIELD), PARAMS_DECODER))
    assert back == EVERY_FIELD
    for name in (f.name for f in dataclasses.fields(SamplingParams)):
        assert getattr(back, name) == getattr(EVERY_FIELD, name), name
    assert DERIVED and all(getattr(back, name) is not None for name in DERIVED)
    assert back.stop_token_ids == [7, 3, 9] and back.top_k == -1
    assert back.stop_token_set == frozenset({3, 7, 9})
    assert back.logit_bias_values.tolist() == [-1.5, 2.0]
    default = params_from_wire(through_the_wire(params_to_wire(SamplingParams()), PARAMS_DECODER))
    assert default == SamplingParams() and default.allowed_token_array is None


def test_requests_travel_with_their_deadline_as_time_left():
    request = GenerateRequest("r-1", "hello", EVERY_FIELD, [4, 5, 6], 1234.5, time.monotonic() + 5)
    submit = through_the_wire(Submit(7, [request_to_wire(request)]), COMMAND_DECODER)
    assert isinstance(submit, Submit) and submit.submission_id == 7
    back = request_from_wire(submit.requests[0])
    assert (back.request_id, back.prompt, back.prompt_token_ids) == ("r-1", "hello", [4, 5, 6])
    assert back.params == EVERY_FIELD and back.arrival_time == 1234.5
    assert abs(back.deadline - request.deadline) < 1.0
    no_deadline = GenerateRequest("r-2", None, SamplingParams(), [1])
    assert request_from_wire(request_to_wire(no_deadline)).deadline is None


def test_invalid_sampling_params_on_the_wire_raise_the_typed_error():
    wire = params_to_wire(SamplingParams())
    wire.top_p = 0.0
    with pytest.raises(InvalidRequestError) as caught:
        params_from_wire(wire)
    assert caught.value.param == "top_p"


def test_every_command_round_trips():
    for message in (Abort(["a", "b"]), Shutdown(), Detach(), Heartbeat()):
        assert through_the_wire(message, COMMAND_DECODER) == message
    for greeting in (Hello(PROTOCOL_VERSION, "host:1:abc", b"n" * 32), Proof(b"p" * 32)):
        assert through_the_wire(greeting, HELLO_DECODER) == greeting
    challenge = Challenge(b"n" * 32, b"p" * 32)
    assert through_the_wire(challenge, HANDSHAKE_DECODER) == challenge


def test_every_event_round_trips():
    delta = RequestDelta(
        "r-1",
        [
            CompletionDelta(0, [5, 6], 3, "xyz", [{5: Logprob(-0.5, 1, "a")}], -0.5, None, None),
            CompletionDelta(1, [], 0, "", None, None, "stop", "END"),
            CompletionDelta(2, [9], 0, "q", None, None, "stop", 2),
        ],
        finished=False,
        metrics=RequestMetrics(1.0, 2.0, 3.0, None, 4, 1),
        num_cached_tokens=4,
        error=None,
        prompt_token_ids=[1, 2],
        prompt_logprobs=[None, {2: Logprob(-1.0, 3, None)}],
    )
    step = StepDeltas(
        ["r-2", "r-3"],
        [2, 0],
        [7, 8],
        ["ab", ""],
        [None, [{4: Logprob(-0.25, 2, None)}]],
        [None, -1.5],
        [delta],
    )
    events = [
        CoreBatch(
            [1, 2],
            [Rejection(3, ErrorInfo("InvalidRequestError", "bad n", "n"))],
            step,
            {"num_steps": 5, "spec_acceptance_rate": 0.5},
        ),
        CoreBatch([], [], None, None),
        CoreStopped("the engine loop failed: RuntimeError('x')", failed=True),
    ]
    for event in events:
        assert through_the_wire(event, EVENT_DECODER) == event
    ready = Ready(PROTOCOL_VERSION, 256, [2, 7], 320, {"temperature": 0.6}, "/m", {"num_steps": 0})
    assert through_the_wire(ready, HANDSHAKE_DECODER) == ready
    assert through_the_wire(Refused("no"), HANDSHAKE_DECODER) == Refused("no")


def test_a_hello_from_another_version_still_decodes():
    """A future client's hello (more fields) reads here, so the refusal can name the version."""

    class FutureHello(msgspec.Struct, tag="hello"):
        protocol_version: int
        client_name: str
        nonce: bytes = b""
        features: list[str] = []

    hello = HELLO_DECODER.decode(ENCODER.encode(FutureHello(PROTOCOL_VERSION + 1, "x", b"", ["y"])))
    assert hello.protocol_version == PROTOCOL_VERSION + 1


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequestError("n must be <= 4", "n"),
        InvalidRequestError("the prompt is empty"),
        ConfigError("max_model_len too large"),
        QueueFullError("the waiting queue is full"),
        UnsupportedByBackendError("cpu", "dtype", "float8", ["float32"]),
        ValueError("plain"),
    ],
)
def test_errors_keep_their_type_message_and_param(error):
    back = error_from(through_the_wire(error_info(error), msgspec.msgpack.Decoder(ErrorInfo)))
    assert type(back) is type(error) and str(back) == str(error)
    assert getattr(back, "param", None) == getattr(error, "param", None)


def test_an_unknown_error_kind_becomes_a_runtime_error_naming_it():
    class WeirdError(Exception):
        pass

    back = error_from(error_info(WeirdError("odd")))
    assert type(back) is RuntimeError and str(back) == "WeirdError: odd"
