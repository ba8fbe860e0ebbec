"""The shared secret between engine fronts and engine cores, and how each side proves it.

The secret comes from a file (``--engine-secret-file``) or, failing that, the environment
(``$PLATFORM_CORE_ENGINE_SECRET``); it never appears on a command line, where ``ps`` shows it to
every user of the host.

It never travels either. Each side sends a fresh random nonce; each then proves it knows the
secret with an HMAC-SHA256 over both nonces and its own role (``ROLE_FRONT``, ``ROLE_ENGINE``).
The role in the MAC stops a peer from reflecting one side's proof back at it as its own, the
nonces from replaying a proof recorded earlier. Both sides check, so an engine does not serve a
front that cannot prove it, and a front does not route requests to an impostor engine. This
authenticates; it does not encrypt: keep ``tcp://`` traffic on a trusted network.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from platform_core.errors import ConfigError, EngineConnectionError

ENGINE_SECRET_ENV = "PLATFORM_CORE_ENGINE_SECRET"
NONCE_BYTES = 32
ROLE_FRONT = b"platform-core front"
ROLE_ENGINE = b"platform-core engine core"


class EngineAuthenticationError(EngineConnectionError):
    """A peer did not prove it knows the shared engine secret (or one side has none)."""


def load_engine_secret(path: str | None = None) -> bytes | None:
    """The secret in the file at ``path``, else in ``$PLATFORM_CORE_ENGINE_SECRET``, else
    ``None`` (no authentication). Surrounding whitespace is dropped; an empty secret, or a file
    that cannot be read, is a ``ConfigError``."""
    if path is not None:
        try:
            text = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read the engine secret file {path!r}: {exc}") from None
        source = f"the engine secret file {path!r}"
    else:
        env = os.environ.get(ENGINE_SECRET_ENV)
        if env is None:
            return None
        text, source = env.encode(), f"${ENGINE_SECRET_ENV}"
    secret = text.strip()
    if not secret:
        raise ConfigError(f"{source} is empty; give a non-empty secret")
    return secret


def new_nonce() -> bytes:
    """A fresh challenge for the peer."""
    return secrets.token_bytes(NONCE_BYTES)


@dataclass(frozen=True, slots=True)
class Nonces:
    """The two challenges of one handshake: the front's and the engine's."""

    front: bytes
    engine: bytes

    def message(self, role: bytes) -> bytes:
        return b"\0".join((role, self.front, self.engine))


def prove(secret: bytes, role: bytes, nonces: Nonces) -> bytes:
    """The proof that the side playing ``role`` knows ``secret``, for these ``nonces``."""
    return hmac.new(secret, nonces.message(role), hashlib.sha256).digest()


def check_proof(
    secret: bytes | None, role: bytes, nonces: Nonces, proof: bytes | None, peer: str
) -> None:
    """Raise ``EngineAuthenticationError`` unless ``proof`` is ``peer``'s valid proof for
    ``role``; with no ``secret`` here, the peer must not have sent one either (one side
    configured with a secret and the other without is a setup error, said as such)."""
    if secret is None:
        if proof is not None:
            raise EngineAuthenticationError(
                f"{peer} requires a shared engine secret and this side has none "
                f"(set --engine-secret-file or ${ENGINE_SECRET_ENV})"
            )
        return
    if proof is None:
        raise EngineAuthenticationError(
            f"{peer} has no shared engine secret and this side requires one"
        )
    if len(nonces.front) != NONCE_BYTES or len(nonces.engine) != NONCE_BYTES:
        raise EngineAuthenticationError(f"{peer} sent a malformed challenge")
    if not hmac.compare_digest(prove(secret, role, nonces), proof):
        raise EngineAuthenticationError(f"{peer} does not know the shared engine secret")
