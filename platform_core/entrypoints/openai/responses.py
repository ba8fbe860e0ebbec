"""Shaping what the completion and chat handlers send back: per-choice deltas for streaming,
usage, prompt logprobs in vLLM's shape, the ignored-fields header and server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.responses import Response, StreamingResponse

from platform_core.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from platform_core.entrypoints.openai.errors import error_event
from platform_core.entrypoints.openai.response_bodies import (
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    UsageInfo,
)

SSE_DONE = "data: [DONE]\n\n"
IGNORED_FIELDS_HEADER = "x-platform-core-ignored-fields"
# The header is cut (ending in ",...") past this many characters: HTTP clients refuse
# header blocks of tens of KB (h11, under httpx and the OpenAI SDK, at 16 KiB).
MAX_IGNORED_HEADER_CHARS = 2048


@dataclass(slots=True)
class Delta:
    """What one choice gained since its previous chunk (``start``: index of its first new token);
    the last delta of a finished request carries its ``kv_transfer_params``."""

    index: int
    text: str
    start: int
    completion: CompletionOutput
    first: bool
    kv_transfer_params: dict[str, Any] | None = None


class DeltaTracker:
    """Turns cumulative outputs into per-choice increments for streaming."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[int, int, bool]] = {}  # choice -> (chars, tokens, finished)

    def deltas(self, first_index: int, output: RequestOutput) -> list[Delta]:
        """Increments of ``output``'s samples; sample ``i`` is choice ``first_index + i``."""
        deltas = []
        for completion in output.outputs:
            index = first_index + completion.index
            sent = self._sent.get(index)
            chars, tokens, done = sent or (0, 0, False)
            if done:
                continue
            text = completion.text[chars:]
            changed = text or len(completion.token_ids) > tokens or completion.finished
            if sent is not None and not changed:
                continue
            deltas.append(Delta(index, text, tokens, completion, first=sent is None))
            self._sent[index] = (
                len(completion.text),
                len(completion.token_ids),
                completion.finished,
            )
        if output.finished and deltas:
            deltas[-1].kv_transfer_params = output.kv_transfer_params
        return deltas


def with_ignored_header(response: Response, ignored: list[str]) -> Response:
    """``response`` naming the ignored request fields in ``IGNORED_FIELDS_HEADER`` (JSON-escaped,
    so any name is one ASCII header line)."""
    if ignored:
        value = ",".join(json.dumps(name)[1:-1] for name in ignored)
        if len(value) > MAX_IGNORED_HEADER_CHARS:
            value = value[:MAX_IGNORED_HEADER_CHARS].rpartition(",")[0] + ",..."
        response.headers[IGNORED_FIELDS_HEADER] = value
    return response


def format_prompt_logprobs(
    positions: list[PositionLogprobs | None] | None,
) -> PromptLogprobs | None:
    """The engine's prompt logprobs in vLLM's response shape."""
    if positions is None:
        return None
    return [
        None
        if position is None
        else {
            t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for t, lp in position.items()
        }
        for position in positions
    ]


def kv_transfer_params(finals: list[RequestOutput]) -> dict[str, Any] | None:
    """What the KV connector returned for a response's request; ``None`` for a response of
    several prompts (which cannot send ``kv_transfer_params``)."""
    return finals[0].kv_transfer_params if len(finals) == 1 else None


def usage(finals: list[RequestOutput], count_completions: bool = True) -> UsageInfo:
    """Token counts over a response's requests (a prompt counts once whatever ``n`` is);
    without ``count_completions`` nothing generated is counted (echo with ``max_tokens: 0``)."""
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = 0
    if count_completions:
        completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=sum(o.num_cached_tokens for o in finals)
        ),
    )


# Characters JSON may leave raw inside strings that line readers (Python's splitlines, which
# httpx and so the OpenAI SDK use) treat as line breaks: escaped, an event stays one line.
_LINE_BREAKS_IN_JSON = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_data(json_text: str) -> str:
    """One server-sent event carrying ``json_text``, on a single line whatever the text holds."""
    return f"data: {json_text.translate(_LINE_BREAKS_IN_JSON)}\n\n"


def event_stream(chunks: AsyncIterator[BaseModel]) -> StreamingResponse:
    """Server-sent events: one ``data: {json}`` per chunk, an error event if the stream breaks,
    then ``data: [DONE]``."""

    async def events() -> AsyncIterator[str]:
        try:
            async with aclosing(chunks) as items:
                async for chunk in items:
                    yield sse_data(chunk.model_dump_json())
        except Exception as exc:  # the status line is sent already: report in-band
            yield error_event(exc)
        yield SSE_DONE

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )
