"""The messages between engine fronts and an engine-core process: msgspec structs, versioned.

Two sockets per client (see ``core_process``). On the *events* socket a client first sends a
``Hello`` (protocol version, its name, a nonce), gets a ``Challenge`` (the core's nonce and its
proof of the shared secret, ``core_auth``), answers with its own ``Proof``, and gets ``Ready``
(what the front needs of the model) or ``Refused``; these are maps, so a core and a client of
different versions still read each other's and the version check can say what is wrong. Then
the client sends ``ClientCommand``s (``Submit``, ``Abort``, ``Shutdown``) on the *commands*
socket and reads ``CoreEvent``s on the events socket: a ``CoreBatch`` per loop iteration
(acceptances, rejections with the typed error, the step's ``StepDeltas``, stats) and
``CoreStopped`` last.
These are tagged arrays: no field names on the wire, no pickling per request.

``SamplingParams`` travels as its constructor arguments (``WireSamplingParams``, made from the
dataclass's own fields) and is rebuilt by its constructor, so the derived fields
(``stop_token_set``, the token-id buffers) come out of ``__post_init__`` as they did on the
sending side. Deadlines travel as seconds left, so the two ends need not share a clock.
"""

from __future__ import annotations

import dataclasses
import time
import typing
from typing import Any

import msgspec

from platform_core import errors
from platform_core.engine.outputs import PositionLogprobs, RequestMetrics
from platform_core.engine.request_stream import GenerateRequest
from platform_core.lora_request import LoRARequest
from platform_core.sampling_params import SamplingParams

PROTOCOL_VERSION = 5

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.init)
_PARAM_TYPES = typing.get_type_hints(SamplingParams)
WireSamplingParams = msgspec.defstruct(
    "WireSamplingParams",
    [(name, _PARAM_TYPES[name]) for name in _PARAM_FIELDS],
    array_like=True,
    module=__name__,
)


def params_to_wire(params: SamplingParams) -> Any:
    """``params`` as its constructor arguments."""
    return WireSamplingParams(*[getattr(params, name) for name in _PARAM_FIELDS])


def params_from_wire(wire: Any) -> SamplingParams:
    """The ``SamplingParams`` the arguments build (validated and normalized again)."""
    return SamplingParams(*msgspec.structs.astuple(wire))


# ---------------------------------------------------------------------------- handshake
class Hello(msgspec.Struct, tag="hello"):
    """A client introduces itself (first message, on the events socket)."""

    protocol_version: int
    client_name: str
    nonce: bytes = b""


class Challenge(msgspec.Struct, tag="challenge"):
    """The core's nonce and, when it has a secret, its proof of it (``core_auth.ROLE_ENGINE``)."""

    nonce: bytes
    proof: bytes | None = None


class Proof(msgspec.Struct, tag="proof"):
    """The client's proof of the secret (``core_auth.ROLE_FRONT``), ``None`` without one."""

    proof: bytes | None = None


class Ready(msgspec.Struct, tag="ready"):
    """The core accepted the client: what the front needs of the model and engine."""

    protocol_version: int
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int
    default_sampling: dict[str, Any]
    model_dir: str
    stats: dict[str, Any]


class Refused(msgspec.Struct, tag="refused"):
    """The core refused the client (protocol version, secret); it will ignore its commands."""

    reason: str


HandshakeReply = Challenge | Ready | Refused


# ---------------------------------------------------------------------------- client -> core
class WireRequest(msgspec.Struct, array_like=True):
    """A ``GenerateRequest``; ``deadline_in`` is the seconds it had left when sent."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: WireSamplingParams  # type: ignore[valid-type]
    arrival_time: float
    deadline_in: float | None
    lora_request: LoRARequest | None = None
    kv_transfer_params: dict[str, Any] | None = None


class Submit(msgspec.Struct, tag="submit", array_like=True):
    """Add these requests together (all or none); the answer names ``submission_id``."""

    submission_id: int
    requests: list[WireRequest]


class Abort(msgspec.Struct, tag="abort", array_like=True):
    """Stop these requests and free their blocks."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Finish the current step, fail what is left, exit."""


class Detach(msgspec.Struct, tag="detach", array_like=True):
    """This client leaves (its requests are aborted); the core serves the others on."""


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    """The client is alive (sent every ``HEARTBEAT_S``; the core answers with empty batches)."""


ClientCommand = Submit | Abort | Shutdown | Detach | Heartbeat

HEARTBEAT_S = 1.0  # each side sends at least this often
# Silence after which a peer counts as gone: a client's requests are aborted, a core fails its
# client's requests. A core step longer than this reads as silence too.
PEER_SILENCE_S = 5.0


def request_to_wire(request: GenerateRequest) -> WireRequest:
    deadline = request.deadline
    return WireRequest(
        request.request_id,
        request.prompt,
        request.prompt_token_ids,
        params_to_wire(request.params),
        request.arrival_time,
        None if deadline is None else deadline - time.monotonic(),
        request.lora_request,
        request.kv_transfer_params,
    )


def request_from_wire(wire: WireRequest) -> GenerateRequest:
    """The request as sent (raises ``InvalidRequestError`` for invalid sampling params)."""
    left = wire.deadline_in
    return GenerateRequest(
        wire.request_id,
        wire.prompt,
        params_from_wire(wire.params),
        wire.prompt_token_ids,
        wire.arrival_time,
        None if left is None else time.monotonic() + left,
        wire.lora_request,
        wire.kv_transfer_params,
    )


# ---------------------------------------------------------------------------- core -> client
class ErrorInfo(msgspec.Struct, array_like=True):
    """An exception by its class name, message and (``InvalidRequestError``) parameter."""

    kind: str
    message: str
    param: str | None = None


class Rejection(msgspec.Struct, array_like=True):
    """Why a submission was refused (none of its requests runs)."""

    submission_id: int
    error: ErrorInfo


# The per-step structs hold no reference cycles: left out of the garbage collector's tracking,
# the thousands made per step are cheaper to create and decode.
class CompletionDelta(msgspec.Struct, array_like=True, gc=False):
    """What one sample gained in a step: the text is ``text[:text_start] + text`` after it."""

    index: int
    token_ids: list[int]
    text_start: int
    text: str
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(msgspec.Struct, array_like=True, gc=False):
    """A request's step in full: its samples' deltas and the fields that are not cumulative.

    ``prompt_token_ids`` comes once, when the client sent text; ``prompt_logprobs`` once;
    ``metrics`` when they changed (``None``: as before).
    """

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    metrics: RequestMetrics | None
    num_cached_tokens: int
    error: str | None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class StepDeltas(msgspec.Struct, array_like=True, gc=False):
    """One step's outputs for one client: the usual requests in columns, the others in full.

    A request is in the columns when only its one sample (index 0) grew, by tokens and
    appended text (and logprobs), and nothing else changed: still running, no error, the same
    metrics and cached tokens, nothing of the prompt left to send. Column ``i`` is request
    ``request_ids[i]``: ``token_counts[i]`` new tokens, the next ones in the flat
    ``token_ids``, ``texts[i]`` appended, its new ``logprobs[i]`` (``None``: it has none) and
    ``cumulative_logprobs[i]``. Any other request is a ``RequestDelta`` in ``others``. A
    request appears once per step.
    """

    request_ids: list[str]
    token_counts: list[int]
    token_ids: list[int]
    texts: list[str]
    logprobs: list[list[PositionLogprobs] | None]
    cumulative_logprobs: list[float | None]
    others: list[RequestDelta]


class CoreBatch(msgspec.Struct, tag="batch", array_like=True):
    """One loop iteration's results for one client: ``outputs`` when its requests had any,
    ``stats`` when they changed."""

    accepted: list[int]
    rejected: list[Rejection]
    outputs: StepDeltas | None
    stats: dict[str, Any] | None


class CoreStopped(msgspec.Struct, tag="stopped", array_like=True):
    """The core left its loop (``failed``: it broke, rather than was shut down); last event."""

    reason: str
    failed: bool


CoreEvent = CoreBatch | CoreStopped


# ---------------------------------------------------------------------------- typed errors
_KINDS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.PlatformCoreError)
}
_KINDS.update(
    (cls.__name__, cls)
    for cls in (ValueError, TypeError, KeyError, RuntimeError, OSError, FileNotFoundError)
)


def error_info(exc: BaseException) -> ErrorInfo:
    """``exc`` as it travels."""
    return ErrorInfo(type(exc).__name__, str(exc), getattr(exc, "param", None))


def error_from(info: ErrorInfo) -> BaseException:
    """The exception ``info`` describes: the same platform-core (or builtin) class with the
    same message and ``param``; ``RuntimeError`` naming the kind for any other class."""
    cls = _KINDS.get(info.kind)
    if cls is None:
        return RuntimeError(f"{info.kind}: {info.message}")
    exc = cls.__new__(cls)
    Exception.__init__(exc, info.message)  # custom constructors take other arguments
    if info.param is not None or issubclass(cls, errors.InvalidRequestError):
        exc.param = info.param  # type: ignore[attr-defined]
    return exc


# ---------------------------------------------------------------------------- codecs
ENCODER = msgspec.msgpack.Encoder()
HELLO_DECODER = msgspec.msgpack.Decoder(Hello | Proof)
HANDSHAKE_DECODER = msgspec.msgpack.Decoder(HandshakeReply)
COMMAND_DECODER = msgspec.msgpack.Decoder(ClientCommand)
EVENT_DECODER = msgspec.msgpack.Decoder(CoreEvent)
ERROR_DECODER = msgspec.msgpack.Decoder(ErrorInfo)
