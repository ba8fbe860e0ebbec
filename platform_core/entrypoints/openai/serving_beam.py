"""Beam search over HTTP (``use_beam_search: true``): ``n`` beams per prompt, answered whole.

``submit`` stands in for ``ServerContext.submit``: with beam search it returns a stream that
runs the search (one engine round per token, see ``engine.beam_search``) and then yields each
prompt's finished output, whose choices are the beams, best first. Everything after it (usage,
metrics, deadlines, disconnects, choice building) is the ordinary path's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from platform_core.engine.beam_search import BeamSearch, BeamSearchParams, beam_request_output
from platform_core.engine.outputs import RequestOutput
from platform_core.engine.request_stream import RequestStream
from platform_core.entrypoints.openai.deadline import RequestClock
from platform_core.entrypoints.openai.protocol import SamplingRequest
from platform_core.entrypoints.openai.serving_base import Prompt, ServerContext
from platform_core.errors import InvalidRequestError
from platform_core.lora_request import LoRARequest
from platform_core.sampling_params import SamplingParams


class BeamSearchStream:
    """A ``RequestStream`` look-alike: one finished output per prompt once the search is done.

    A failed round ends the stream with that round's error (as the ordinary path reports it);
    leaving early aborts the round in flight.
    """

    def __init__(
        self,
        ctx: ServerContext,
        request_id: str,
        prompts: list[Prompt],
        search: BeamSearch,
        clock: RequestClock,
        lora: LoRARequest | None,
    ) -> None:
        self.request_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self._ctx = ctx
        self._request_id = request_id
        self._prompts = prompts
        self._search = search
        self._clock = clock
        self._lora = lora

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        search, round_no = self._search, 0
        while not search.done:
            round_no += 1
            beams = [Prompt(None, tokens) for tokens in search.pending()]
            stream = await self._ctx.submit(
                f"{self._request_id}-round{round_no}",
                beams,
                search.step_params,
                self._clock,
                self._lora,
            )
            outputs = await _finals(stream)
            failed = next((o for o in outputs if o.error is not None), None)
            if failed is not None:
                for request_id, prompt in zip(self.request_ids, self._prompts):
                    yield RequestOutput(
                        request_id, prompt.text, prompt.token_ids, [], True, error=failed.error
                    )
                return
            search.advance(outputs)
        results = await asyncio.to_thread(search.outputs, self._ctx.engine.tokenizer)
        for request_id, prompt, result in zip(self.request_ids, self._prompts, results):
            yield beam_request_output(request_id, prompt.text, result)


async def _finals(stream: RequestStream) -> list[RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    async with aclosing(aiter(stream)) as outputs:
        async for output in outputs:
            finals[output.request_id] = output
    return [finals[r] for r in stream.request_ids]


async def submit_or_search(
    ctx: ServerContext,
    body: SamplingRequest,
    request_id: str,
    prompts: list[Prompt],
    params: SamplingParams,
    clock: RequestClock,
    lora: LoRARequest | None,
) -> RequestStream | BeamSearchStream:
    """``ctx.submit``, or with ``body.use_beam_search`` a beam search of ``params.n`` beams;
    either runs with the adapter ``lora`` if given.

    ``body.kv_transfer_params`` go to the engine with the one request of a single prompt; with
    beam search (a request per beam and token) or several prompts (requests that would share
    them) they are a 400.
    """
    kv_transfer_params = body.kv_transfer_params
    if kv_transfer_params is not None and (body.use_beam_search or len(prompts) > 1):
        reason = "beam search" if body.use_beam_search else f"{len(prompts)} prompts"
        raise InvalidRequestError(
            f"kv_transfer_params apply to a single prompt without beam search, not to {reason}",
            "kv_transfer_params",
        )
    if not body.use_beam_search:
        return await ctx.submit(request_id, prompts, params, clock, lora, kv_transfer_params)
    if body.stream:
        raise InvalidRequestError("streaming is not supported with beam search", "stream")
    try:
        beam_params = BeamSearchParams.from_sampling(params, body.length_penalty)
        search = BeamSearch(
            [p.token_ids for p in prompts],
            beam_params,
            ctx.engine.eos_token_ids,
            ctx.engine.max_model_len,
        )
    except InvalidRequestError as exc:
        if exc.param == "beam_width":
            exc.param = "n"
        raise
    return BeamSearchStream(ctx, request_id, prompts, search, clock, lora)
