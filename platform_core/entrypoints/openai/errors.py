"""Every error the server returns, in OpenAI's shape: ``{"error": {message, type, param, code}}``.

Status codes: 400 invalid request (pydantic validation errors included, reshaped), 401 missing or
wrong API key, 404 unknown model, LoRA adapter or route, 408 the request's own ``timeout`` passed
(queueing included), 413 body too large, 503 engine not running, waiting queue full (with
``Retry-After``) or the server shutting down, 500 only for a bug (logged with its traceback).
Messages never carry text that JSON cannot encode as UTF-8 (lone surrogates sent by a client are
escaped).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from platform_core.errors import (
    DeadlineExceededError,
    EngineDeadError,
    InvalidRequestError,
    PlatformCoreError,
    QueueFullError,
    RequestFailedError,
)

logger = logging.getLogger("platform_core.server")

# Seconds a client refused for back-pressure should wait; a queue slot frees within a few steps.
RETRY_AFTER_SECONDS = 1

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    500: "server_error",
    502: "server_error",  # the proxy's: an upstream instance failed
    503: "service_unavailable_error",
}


class ModelNotFoundError(PlatformCoreError):
    """The request names a model this server does not serve."""

    def __init__(self, model: str) -> None:
        # The served name is not repeated: by default it is the --model value, often a path on
        # disk; GET /v1/models tells an authorized client what it is.
        super().__init__(f"the model {model!r} does not exist; GET /v1/models lists the served one")


class LoRANotFoundError(PlatformCoreError):
    """An unload names a LoRA adapter the server does not serve."""

    def __init__(self, what: str) -> None:
        super().__init__(f"no LoRA adapter {what} is loaded; GET /v1/models lists them")


class RequestTimeoutError(PlatformCoreError):
    """The request's ``timeout`` passed before it finished; it has been aborted."""

    def __init__(self) -> None:
        super().__init__("the request did not finish within its timeout; it was aborted")


class ServerShuttingDownError(PlatformCoreError):
    """The server is stopping and the request did not finish within ``--shutdown-timeout``."""

    def __init__(self) -> None:
        super().__init__("the server is shutting down; the request was aborted, retry elsewhere")


def _printable(text: str | None) -> str | None:
    """``text`` with lone surrogates escaped, so the error body always encodes as UTF-8."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object for ``status``."""
    return {
        "error": {
            "message": _printable(message),
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": _printable(param),
            "code": code,
        }
    }


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def error_event(exc: Exception) -> str:
    """A server-sent event carrying the error that ended a stream early."""
    _, body = _classify(exc)
    return f"data: {json.dumps(body)}\n\n"


def _classify(exc: Exception) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, QueueFullError):
        return 503, error_body(503, str(exc), code="queue_full")
    if isinstance(exc, ServerShuttingDownError):
        return 503, error_body(503, str(exc), code="server_shutting_down")
    if isinstance(exc, RequestTimeoutError | DeadlineExceededError):
        return 408, error_body(408, str(exc), "timeout", "deadline_exceeded")
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(400, str(exc), exc.param)
    if isinstance(exc, ModelNotFoundError):
        return 404, error_body(404, str(exc), "model", "model_not_found")
    if isinstance(exc, LoRANotFoundError):
        return 404, error_body(404, str(exc), "lora_name", "lora_not_found")
    if isinstance(exc, EngineDeadError):
        return 503, error_body(503, str(exc), code="engine_unavailable")
    if isinstance(exc, RequestFailedError):
        return 500, error_body(500, str(exc), code="request_failed")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return 500, error_body(500, "internal server error; see the server log")


# Error types that only say "not this member of a union"; another error says more.
_TYPE_MISMATCHES = frozenset(
    {"string_type", "int_type", "float_type", "bool_type", "list_type", "dict_type", "model_type"}
)
_TYPE_NAMES = frozenset({"str", "int", "float", "bool"})


def _is_field(part: object) -> bool:
    """Whether a pydantic ``loc`` part names a field or index, not a union member's type
    (``str``, ``list[constrained-int]``, ``function-after[...]``) or a dict's ``[key]``."""
    if isinstance(part, int):
        return True
    text = str(part)
    return text != "body" and "[" not in text and "-" not in text and text not in _TYPE_NAMES


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = next((e for e in errors if e.get("type") not in _TYPE_MISMATCHES), errors[0])
    loc = [str(p) for p in first.get("loc", ()) if _is_field(p)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":  # its location is an offset, not a field
        error = (first.get("ctx") or {}).get("error", "")
        return f"the body is not valid JSON: {error} (at offset {loc[0] if loc else 0})", None
    message = f"{param or 'body'}: {first.get('msg')}"
    more = len(errors) - 1
    return message + (f" (and {more} more error{'s' * (more > 1)})" if more else ""), param


def install_error_handlers(app: FastAPI) -> None:
    """Map exceptions raised by routes (and by FastAPI itself) to OpenAI error responses."""

    async def on_platform_error(request: Request, exc: Exception) -> JSONResponse:
        status, body = _classify(exc)
        headers = None
        if isinstance(exc, QueueFullError):
            headers = {"retry-after": str(RETRY_AFTER_SECONDS)}
        return JSONResponse(body, status_code=status, headers=headers)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        return JSONResponse(
            error_body(status, str(exc.detail)), status_code=status, headers=exc.headers
        )

    app.add_exception_handler(PlatformCoreError, on_platform_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_platform_error)
