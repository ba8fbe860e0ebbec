"""The engine's side of constrained decoding: compile off the loop, mask each step, track state.

Life of a constrained request:

1. ``check`` (at ``add_request``) builds the grammar with the first engine of
   ``structured_outputs_backend`` that takes the constraint; none does: ``InvalidRequestError``.
2. ``submit`` starts compiling it for the vocabulary on a worker thread, or finds it compiled
   (grammars are cached by constraint). A request whose grammar is not ready is *parked*: it is
   not in the scheduler, so it neither runs nor holds up others; ``take_ready`` hands it over
   once compiled.
3. Each step, ``fill_bitmasks`` gives every sampling request with a constraint the bitmask of its
   next token, and one more row per speculative draft: drafts are fed to the matcher in turn
   (and rolled back after), so each draft is verified against the grammar's mask at its
   position. A draft the grammar refuses leaves the rows after it unconstrained; verification
   rejects that draft, so those rows are never sampled. When the reasoning ends inside the
   drafts, the rows after its end are constrained from the grammar's start.
4. ``advance`` feeds the step's accepted tokens to each sample's matcher; a token the grammar
   refuses fails the request, a grammar that accepted its end finishes it.

A sample's matcher always reflects its output tokens: it is (re)built by replaying them when
missing. Preemption drops it (a preempted request holds no state) and the first step after
recompute rebuilds it. With a reasoning parser, the constraint starts at the first token after
the reasoning ends; until then the sample is unconstrained.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from platform_core.errors import InvalidRequestError
from platform_core.scheduler.output import ScheduledRequest
from platform_core.scheduler.request import Request
from platform_core.structured_output.engines import (
    ENGINE_ORDER,
    GRAMMAR_ENGINES,
    CompiledGrammar,
    GrammarEngine,
    GrammarMatcher,
)
from platform_core.structured_outputs_params import PARAM, StructuredOutputsParams

logger = logging.getLogger("platform_core.structured_output")

# Distinct constraints kept compiled; the least recently used one goes first.
MAX_CACHED_GRAMMARS = 256


class ReasoningEnd(Protocol):
    """Where the content after a model's reasoning starts (``platform_core.reasoning``)."""

    def content_start(self, output_token_ids: list[int], searched: int = 0) -> int | None: ...

    def reasoning_ended_in_prompt(self, prompt_token_ids: list[int]) -> bool: ...


class GrammarViolationError(Exception):
    """A sampled token the grammar does not allow (a broken bitmask, or a forced token)."""


@dataclass(slots=True)
class _SampleGrammar:
    """One output sequence's grammar state: ``num_fed`` output tokens went into ``matcher``.

    ``content_start`` is where the constrained output begins (None: still reasoning; the first
    ``num_searched`` output tokens hold no end of reasoning).
    """

    compiled: CompiledGrammar
    content_start: int | None
    matcher: GrammarMatcher | None = None
    num_fed: int = 0
    num_searched: int = 0


@dataclass(slots=True)
class CompileTiming:
    """Seconds spent compiling, and how many compiles and cache hits there were."""

    compiles: int = 0
    hits: int = 0
    seconds: float = 0.0


class StructuredOutputManager:
    """Compiles, caches and applies the constraints of one engine's requests."""

    def __init__(
        self,
        backend: str,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        reasoning: ReasoningEnd | None = None,
    ) -> None:
        stops = sorted(stop_token_ids)
        self._engines: list[GrammarEngine] = [
            GRAMMAR_ENGINES[name](tokenizer, vocab_size, stops) for name in ENGINE_ORDER[backend]
        ]
        self._has_tokenizer = tokenizer is not None
        self.bitmask_width = (vocab_size + 31) // 32
        self.reasoning = reasoning
        self.timing = CompileTiming()
        # params key -> (engine, prepared grammar) / compiled grammar; both LRU-bounded
        self._prepared: OrderedDict[tuple, tuple[GrammarEngine, Any]] = OrderedDict()
        self._compiled: OrderedDict[tuple, Future[CompiledGrammar]] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._parked: dict[str, tuple[Request, Future[CompiledGrammar]]] = {}
        self._samples: dict[str, _SampleGrammar] = {}

    # ---------------------------------------------------------------- admission
    def check(self, params: StructuredOutputsParams) -> None:
        """Raise ``InvalidRequestError`` when no configured engine can take ``params``."""
        self._prepare(params)

    def _prepare(self, params: StructuredOutputsParams) -> tuple[GrammarEngine, Any]:
        found = self._prepared.get(params.key)
        if found is not None:
            self._prepared.move_to_end(params.key)
            return found
        if not self._has_tokenizer:
            raise InvalidRequestError(
                f"{PARAM} needs the model's tokenizer (the engine runs without one)", PARAM
            )
        errors = []
        for engine in self._engines:
            try:
                found = engine, engine.prepare(params)
                break
            except InvalidRequestError as exc:
                errors.append(str(exc))
        else:
            raise InvalidRequestError("; ".join(errors), PARAM)
        if errors:
            logger.info("%s fell back to %s: %s", PARAM, found[0].name, errors[0])
        _put(self._prepared, params.key, found)
        return found

    def submit(self, request: Request) -> bool:
        """Start compiling ``request``'s constraint; True when it is ready now (cached).

        A request not ready is parked here until ``take_ready`` returns it.
        """
        future = self._compile(request.sampling_params.structured_outputs)
        if future.done() and future.exception() is None:
            return True
        self._parked[request.request_id] = (request, future)
        return False

    def _compile(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        future = self._compiled.get(params.key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._compiled.move_to_end(params.key)
            self.timing.hits += 1
            return future
        engine, prepared = self._prepare(params)
        future = self._pool.submit(self._timed_compile, engine, prepared)
        _put(self._compiled, params.key, future)
        return future

    def _timed_compile(self, engine: GrammarEngine, prepared: Any) -> CompiledGrammar:
        start = time.perf_counter()
        compiled = engine.compile(prepared)
        self.timing.compiles += 1
        self.timing.seconds += time.perf_counter() - start
        return compiled

    @property
    def num_parked(self) -> int:
        """Requests waiting for their grammar."""
        return len(self._parked)

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The parked requests whose grammar compiled, and those whose compile failed (with
        the reason), in the order they arrived; both leave the parking."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for request_id, (request, future) in list(self._parked.items()):
            if not future.done():
                continue
            del self._parked[request_id]
            error = future.exception()
            if error is None:
                ready.append(request)
            else:
                failed.append((request, f"{PARAM} failed to compile: {error}"))
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a parked request's compile finishes, at most ``timeout`` seconds."""
        futures = [future for _, future in self._parked.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def forget(self, sample_ids: Iterable[str]) -> None:
        """Drop the parking and grammar state of finished samples (unknown ids are ignored)."""
        for sample_id in sample_ids:
            self._parked.pop(sample_id, None)
            self._samples.pop(sample_id, None)

    def drop_matchers(self, sample_ids: Iterable[str]) -> None:
        """Preempted samples hold no matcher; it is rebuilt from their tokens when they run."""
        for sample_id in sample_ids:
            sample = self._samples.get(sample_id)
            if sample is not None:
                sample.matcher = None

    # ---------------------------------------------------------------- steps
    def fill_bitmasks(self, scheduled: list[ScheduledRequest]) -> None:
        """Set ``token_bitmask`` (``[1 + drafts, words]`` int32) of every constrained request
        that samples this step; rows of drafts the grammar refuses, and rows still in the
        reasoning, stay all ones."""
        if not self._samples and not self._compiled:
            return  # no request ever had a constraint: nothing to look at
        for item in scheduled:
            params = item.sampling_params.structured_outputs
            if params is None or not item.sample:
                continue
            sample = self._sample(item.request_id, params, item.prompt_token_ids)
            drafts = item.draft_token_ids
            bitmask = torch.full((1 + len(drafts), self.bitmask_width), -1, dtype=torch.int32)
            matcher = self._synced(sample, item.output_token_ids)
            if matcher is not None:
                fed = _fill_rows(matcher, bitmask, 0, drafts)
                if fed:
                    matcher.rollback(fed)
            elif drafts:  # the reasoning may end inside the drafts: constrain the rows after
                first = self._content_row(sample, item.output_token_ids, drafts)
                if first is None:
                    continue
                _fill_rows(sample.compiled.matcher(), bitmask, first, drafts[first:])
            else:
                continue
            item.token_bitmask = bitmask

    def _content_row(
        self, sample: _SampleGrammar, output_token_ids: list[int], drafts: list[int]
    ) -> int | None:
        """The first row (``0..len(drafts)``) after the end of the reasoning when it ends
        inside ``drafts``, else None."""
        start = self.reasoning.content_start([*output_token_ids, *drafts], sample.num_searched)
        return None if start is None else start - len(output_token_ids)

    def advance(
        self, sampled: dict[str, list[int]], find_request: Callable[[str], Request | None]
    ) -> tuple[dict[str, str], list[str]]:
        """Feed the step's new tokens to the matchers of constrained samples.

        Returns the samples to fail (id -> reason: a token outside the grammar) and the ids of
        unfinished samples whose grammar accepted its end (to finish as stopped).
        """
        errors: dict[str, str] = {}
        ended: list[str] = []
        if not self._samples:
            return errors, ended
        for sample_id in sampled:
            request = find_request(sample_id)
            if request is None or request.status.finished:
                continue
            params = request.sampling_params.structured_outputs
            if params is None:
                continue
            sample = self._sample(sample_id, params, request.prompt_token_ids)
            try:
                matcher = self._synced(sample, request.output_token_ids)
            except GrammarViolationError as exc:
                errors[sample_id] = str(exc)
                continue
            if matcher is not None and matcher.is_terminated():
                ended.append(sample_id)
        return errors, ended

    def _sample(
        self, sample_id: str, params: StructuredOutputsParams, prompt_token_ids: list[int]
    ) -> _SampleGrammar:
        sample = self._samples.get(sample_id)
        if sample is None:
            # Compiled before the request was scheduled; a fork child shares its parent's key.
            compiled = (self._compiled.get(params.key) or self._compile(params)).result()
            reasoning = self.reasoning
            constrained_now = reasoning is None or reasoning.reasoning_ended_in_prompt(
                prompt_token_ids
            )
            start = 0 if constrained_now else None
            sample = self._samples[sample_id] = _SampleGrammar(compiled, content_start=start)
        return sample

    def _synced(self, sample: _SampleGrammar, output_token_ids: list[int]) -> GrammarMatcher | None:
        """The sample's matcher after all its output tokens (None while it is reasoning)."""
        if sample.content_start is None:
            sample.content_start = self.reasoning.content_start(
                output_token_ids, sample.num_searched
            )
            if sample.content_start is None:
                sample.num_searched = len(output_token_ids)
                return None
        if sample.matcher is None:
            sample.matcher = sample.compiled.matcher()
            sample.num_fed = sample.content_start
        matcher = sample.matcher
        while sample.num_fed < len(output_token_ids):
            token = output_token_ids[sample.num_fed]
            if not matcher.accept_token(token):
                raise GrammarViolationError(
                    f"token {token} at output position {sample.num_fed} is outside the "
                    f"{PARAM} grammar"
                )
            sample.num_fed += 1
        return matcher

    def shutdown(self) -> None:
        """Stop the compile thread (compiles in flight finish first)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _fill_rows(matcher: GrammarMatcher, bitmask: torch.Tensor, row: int, drafts: list[int]) -> int:
    """Fill ``bitmask[row]`` from ``matcher``, then feed it the drafts one by one, filling the
    next row after each, until one is refused or the grammar ended; how many drafts it took."""
    matcher.fill_bitmask(bitmask, row)
    fed = 0
    for draft in drafts:
        if matcher.is_terminated() or not matcher.accept_token(draft):
            break
        fed += 1
        matcher.fill_bitmask(bitmask, row + fed)
    return fed


def _put(cache: OrderedDict, key: tuple, value: Any) -> None:
    cache[key] = value
    while len(cache) > MAX_CACHED_GRAMMARS:
        cache.popitem(last=False)
