"""Server settings shared by the ``serve`` flags and the server itself (kept import-light)."""

from __future__ import annotations

from dataclasses import dataclass

# The body is decoded on the event loop (see body.py): 4 MiB bounds that pause at about 40 ms
# (half a million token ids) while leaving room for any prompt a context holds (128k token ids
# are under 1 MiB of JSON).
DEFAULT_MAX_BODY_BYTES = 4 << 20
API_KEY_ENV = "PLATFORM_CORE_API_KEY"

# Why these defaults: a batch API client sends at most a few hundred prompts per request, and
# every prompt x n is one sequence competing with every other client's; 1024 leaves room for
# batch use while 200,000 (which stalled other clients for minutes) is refused before anything
# is tokenized or queued.
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024
DEFAULT_MAX_CHOICES_PER_REQUEST = 1024
# allowed_token_ids / stop_token_ids / logit_bias are applied at every step of the request, so
# their length is a per-token cost every other request in the batch pays; real constraint
# lists are tens to a few thousand ids (ids must be below the vocabulary size anyway).
DEFAULT_MAX_TOKEN_ID_LIST_LENGTH = 8192
# Tokens per choice a stream may have generated and not yet sent before its client counts as not
# reading: its requests are then aborted and their KV blocks freed. A reader that keeps up lags by
# about one engine step (a token or a few per choice); 2048 is minutes of reading at any human
# pace and tens of seconds of a stalled socket at this engine's speed.
DEFAULT_MAX_STREAM_BUFFER_TOKENS = 2048
# A client has this long to send a whole request (headers and body); slowloris-style
# connections are closed after it. 30 s lets an 8 MB body through at ~300 KB/s.
DEFAULT_READ_TIMEOUT = 30.0
# Threads that tokenize, render chat templates and detokenize requests off the event loop;
# HF tokenizers release the GIL while encoding, so two keep both cores of a small box busy.
DEFAULT_TOKENIZER_THREADS = 2
# Hostnames that always name this machine; a loopback server accepts only these by default
# (a DNS-rebinding page gets its own hostname in Host and is refused).
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on what one request may ask for; over a bound is a 400 naming the field."""

    max_prompts: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_choices: int = DEFAULT_MAX_CHOICES_PER_REQUEST
    max_token_id_list: int = DEFAULT_MAX_TOKEN_ID_LIST_LENGTH
    max_stream_buffer_tokens: int = DEFAULT_MAX_STREAM_BUFFER_TOKENS  # per choice


def default_allowed_hosts(bound_host: str) -> tuple[str, ...]:
    """Host headers accepted when ``--allowed-hosts`` is not given.

    Bound to loopback: the local names and the bound address (the only names a local client
    uses). Bound anywhere else: any host (``*``), since the server's public names are not known.
    """
    host = bound_host.strip("[]")
    if host in LOCAL_HOSTS or host.startswith("127."):
        return tuple(dict.fromkeys((*LOCAL_HOSTS, host)))
    return (ANY_HOST,)
