"""Beam search driven over the engine: one single-token request per live beam per step.

Each step asks the engine for the top log-probabilities after every live beam (a request whose
prompt is the beam's tokens, ``max_tokens=1``); the best continuations over all beams of a prompt
become the next step's beams. The beams of a prompt share their prompt and common-prefix KV blocks
through the prefix cache: a beam's full blocks were computed (and cached) by the previous step, so
only the tokens after its last full block are recomputed.

The selection follows Hugging Face transformers' ``generate(num_beams=k, do_sample=False)``: keep
the best ``max(2, 1 + number of EOS ids) * k`` continuations; one ending in EOS (or reaching
``max_tokens``) among the best ``k`` is a finished hypothesis scored
``cum_logprob / generated_len ** length_penalty`` (EOS counted), the best ``k`` others live on;
``early_stopping`` ends the search as transformers does (``True``: once ``k`` hypotheses are
finished; ``False``: once no live beam could beat the worst of them at its current length;
``"never"``: as ``False`` but assuming ``max_tokens`` when ``length_penalty > 0``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from platform_core.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from platform_core.errors import InvalidRequestError, RequestFailedError
from platform_core.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(slots=True)
class BeamSearchParams:
    """How to run a beam search (vLLM's fields, plus transformers' ``early_stopping``).

    Beams are ranked by the model's raw log-probabilities, so ``temperature`` (kept for vLLM
    compatibility) does not change the result, as in vLLM. The EOS token stays in a finished
    beam's ``tokens`` (its log-probability is in the score) but not in its text unless
    ``include_stop_str_in_output``.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}", name)
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or (name == "temperature" and value < 0):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
        if self.early_stopping not in (True, False, "never"):
            raise InvalidRequestError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}",
                "early_stopping",
            )

    @classmethod
    def from_sampling(cls, params: SamplingParams, length_penalty: float) -> BeamSearchParams:
        """Beam search with ``params.n`` beams and ``params``' length and stopping controls."""
        return cls(
            beam_width=params.n,
            max_tokens=params.max_tokens or 1,
            ignore_eos=params.ignore_eos,
            temperature=params.temperature,
            length_penalty=length_penalty,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt then the generated tokens."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0


@dataclass(slots=True)
class _Group:
    """The search state of one prompt."""

    prompt: list[int]
    max_tokens: int
    running: list[BeamSearchSequence]
    finished: list[tuple[float, BeamSearchSequence]] = field(default_factory=list)
    steps: int = 0
    done: bool = False
    num_cached_tokens: int = 0


class BeamSearch:
    """Beam search over several prompts at once, one engine round per generated token.

    Drive it with ``while not search.done: search.advance(run(search.pending(),
    search.step_params))`` where ``run`` returns one finished ``RequestOutput`` per pending
    token list, in order; then ``search.outputs(tokenizer)``.
    """

    def __init__(
        self,
        prompts: Sequence[list[int]],
        params: BeamSearchParams,
        eos_token_ids: Iterable[int],
        max_model_len: int,
    ) -> None:
        self.params = params
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.keep = max(2, 1 + len(self.eos)) * params.beam_width
        if self.keep > MAX_LOGPROBS:
            raise InvalidRequestError(
                f"beam search with {params.beam_width} beams needs the top {self.keep} tokens "
                f"after each beam; at most {MAX_LOGPROBS} are available, so at most "
                f"{MAX_LOGPROBS // (self.keep // params.beam_width)} beams for this model",
                "beam_width",
            )
        self.step_params = SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=self.keep, ignore_eos=True, detokenize=False
        )
        self._groups = [
            _Group(
                list(p),
                max(1, min(params.max_tokens, max_model_len - len(p))),
                [BeamSearchSequence(list(p))],
            )
            for p in prompts
        ]

    @property
    def done(self) -> bool:
        return all(g.done for g in self._groups)

    def pending(self) -> list[list[int]]:
        """The tokens of every live beam of every unfinished prompt: the next round's prompts."""
        return [b.tokens for g in self._groups if not g.done for b in g.running]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Take one round's outputs (one per ``pending()`` entry, in order) and select beams."""
        it = iter(outputs)
        for group in self._groups:
            if group.done:
                continue
            results = [next(it) for _ in group.running]
            failed = next((r.error for r in results if r.error is not None), None)
            if failed is not None:
                raise RequestFailedError(f"a beam search step failed in the engine: {failed}")
            if group.steps == 0:
                group.num_cached_tokens = results[0].num_cached_tokens
            self._select(group, [r.outputs[0].logprobs[0] for r in results])

    def _select(self, group: _Group, positions: list[PositionLogprobs]) -> None:
        params, k = self.params, self.params.beam_width
        candidates = sorted(
            (
                (beam.cum_logprob + entry.logprob, token, beam, position)
                for beam, position in zip(group.running, positions)
                for token, entry in position.items()
            ),
            key=lambda c: -c[0],
        )[: self.keep]
        length = group.steps + 1
        at_limit = length >= group.max_tokens
        running = []
        for rank, (cum, token, beam, position) in enumerate(candidates):
            seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [position], cum)
            if token in self.eos or at_limit:
                if rank < k:
                    seq.finish_reason = "stop" if token in self.eos else "length"
                    group.finished.append((cum / length**params.length_penalty, seq))
            elif len(running) < k:
                running.append(seq)
        group.finished.sort(key=lambda f: -f[0])
        del group.finished[k:]
        group.running, group.steps = running, length
        group.done = at_limit or not running or self._can_stop(group)

    def _can_stop(self, group: _Group) -> bool:
        params = self.params
        if len(group.finished) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        length = group.steps
        if params.early_stopping == "never" and params.length_penalty > 0:
            length = group.max_tokens
        best_possible = group.running[0].cum_logprob / length**params.length_penalty
        return best_possible <= group.finished[-1][0]

    def outputs(self, tokenizer: Any | None) -> list[BeamSearchOutput]:
        """The best beams of each prompt (the finished hypotheses, best first), with their text
        when ``tokenizer`` is given."""
        results = []
        for group in self._groups:
            best = [seq for _, seq in group.finished]
            if tokenizer is not None:
                for seq in best:
                    seq.text = tokenizer.decode(
                        self._text_tokens(seq, len(group.prompt)),
                        skip_special_tokens=self.params.skip_special_tokens,
                    )
            results.append(BeamSearchOutput(best, group.prompt, group.num_cached_tokens))
        return results

    def _text_tokens(self, seq: BeamSearchSequence, prompt_len: int) -> list[int]:
        generated = seq.tokens[prompt_len:]
        if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            return generated[:-1]
        return generated


def beam_request_output(
    request_id: str, prompt: str | None, output: BeamSearchOutput
) -> RequestOutput:
    """A finished ``RequestOutput`` with one completion per beam (``index`` = rank)."""
    prompt_len = len(output.prompt_token_ids)
    completions = [
        CompletionOutput(
            index=i,
            text=seq.text or "",
            token_ids=seq.tokens[prompt_len:],
            finish_reason=seq.finish_reason,
            logprobs=seq.logprobs,
            cumulative_logprob=seq.cum_logprob,
        )
        for i, seq in enumerate(output.sequences)
    ]
    return RequestOutput(
        request_id,
        prompt,
        output.prompt_token_ids,
        completions,
        finished=True,
        num_cached_tokens=output.num_cached_tokens,
    )
