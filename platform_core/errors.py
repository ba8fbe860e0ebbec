"""Typed exceptions raised by platform-core; the server maps them to HTTP status codes."""


class PlatformCoreError(Exception):
    """Base class of every error platform-core raises on purpose."""


class ConfigError(PlatformCoreError, ValueError):
    """An invalid or unknown configuration value."""


class InvalidRequestError(PlatformCoreError, ValueError):
    """A request the engine cannot accept (bad parameters, prompt too long, ...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be served (missing files, rank above the limit, a target
    module the model lacks, weights not in safetensors, shapes that do not fit)."""


class BackendError(PlatformCoreError, RuntimeError):
    """A backend could not be found, loaded, or chosen."""


class UnsupportedByBackendError(BackendError):
    """The configuration asks for something the chosen backend does not declare."""

    def __init__(self, backend: str, capability: str, value: object, valid: object) -> None:
        super().__init__(
            f"backend {backend!r} does not support {capability}={value!r}; valid values: {valid}"
        )
        self.backend = backend
        self.capability = capability
        self.value = value
        self.valid = valid


class ModelLoadError(PlatformCoreError, RuntimeError):
    """A model could not be located or loaded."""


class QueueFullError(PlatformCoreError, RuntimeError):
    """The waiting queue is at its limit; the caller should retry later (HTTP 503)."""


class RequestFailedError(PlatformCoreError, RuntimeError):
    """One request failed inside the engine (the others go on); the message says why."""


class StreamBackpressureError(RequestFailedError):
    """The client stopped reading its stream: the engine aborted its requests (the limit is
    ``max_buffered_tokens`` of ``SubmitFront.submit``)."""


class DeadlineExceededError(PlatformCoreError, TimeoutError):
    """A request's deadline passed before the engine accepted it; it was aborted (HTTP 408)."""


class EngineDeadError(PlatformCoreError, RuntimeError):
    """The engine hit an unrecoverable error and serves no more requests."""


class ProcessStartError(PlatformCoreError, RuntimeError):
    """A child process failed or died before it was ready, or ranks did not meet in time; the
    message carries the child's traceback or exit status."""


class UnguardedMainError(PlatformCoreError, RuntimeError):
    """Child processes must be spawned, and spawning would re-run the main script's top-level
    code that starts them (the script lacks an ``if __name__ == "__main__":`` guard)."""


class EngineConnectionError(PlatformCoreError, ConnectionError):
    """A front could not connect to an engine core: it refused the handshake (protocol version,
    shared secret) or did not answer."""
