"""The offline API: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from platform_core.config import EngineConfig
from platform_core.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from platform_core.engine.llm_engine import LLMEngine
from platform_core.engine.outputs import RequestOutput
from platform_core.entrypoints.chat_template import Message, render_chat
from platform_core.errors import InvalidRequestError
from platform_core.sampling_params import SamplingParams
from platform_core.worker.kv_tensors import KVCacheInfo

PromptType = str | dict[str, Any]


class LLM:
    """Generate completions for batches of prompts on one model.

    Keyword arguments are engine config keys (``dtype``, ``block_size``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ``kv_cache_memory_bytes``, ``seed``,
    ``backend``, ...); an unknown key raises ``ConfigError`` naming it.
    """

    def __init__(
        self, model: str | None = None, *, config: EngineConfig | None = None, **kwargs: Any
    ) -> None:
        if config is None:
            config = EngineConfig.from_flat(model=model, **kwargs)
        elif model is not None or kwargs:
            raise TypeError("pass either config= or model/config keys, not both")
        self.engine = LLMEngine(config)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine, under vLLM's attribute name (``engine`` is the same object)."""
        return self.engine

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (``None`` for a model without one), as vLLM's
        ``LLM.get_tokenizer()``."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams carrying the model's generation-config defaults."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string or ``{"prompt_token_ids": [...]}`` (optionally with ``"prompt"``).
        ``sampling_params`` is one for all prompts or one per prompt.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = self._params_for(len(prompts), sampling_params)
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_ids.append(self._add(prompt, params))
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt_token_ids": render_chat(
                    self.tokenizer, conversation, add_generation_prompt, chat_template
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The best ``params.beam_width`` beams of each prompt, in input order.

        Every round runs one single-token request per live beam (all prompts batched); beams
        share their common prefix's KV blocks through the prefix cache. See
        ``engine.beam_search`` for how beams are selected and scored.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        engine = self.engine
        search = BeamSearch(
            [self._prompt_ids(p) for p in prompts],
            params,
            engine.eos_token_ids,
            engine.max_model_len,
        )
        with tqdm(total=params.max_tokens, desc="beam search", disable=not use_tqdm) as bar:
            while not search.done:
                rounds = [{"prompt_token_ids": tokens} for tokens in search.pending()]
                search.advance(self.generate(rounds, search.step_params, use_tqdm=False))
                bar.update(1)
        return search.outputs(self.tokenizer)

    def _prompt_ids(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return self.engine.tokenize(prompt)
        raise InvalidRequestError(
            "a prompt must be a string or a dict with 'prompt_token_ids' or 'prompt'", "prompts"
        )

    def _params_for(
        self, count: int, params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise InvalidRequestError(
                f"got {len(params)} sampling params for {count} prompts", "sampling_params"
            )
        return list(params)

    def _add(self, prompt: PromptType, params: SamplingParams) -> str:
        request_id = self.engine.new_request_id()
        # generate() returns final outputs only: the engine need not build one every step.
        if isinstance(prompt, str):
            self.engine.add_request(request_id, prompt, params, stream=False)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            self.engine.add_request(
                request_id,
                prompt.get("prompt"),
                params,
                prompt_token_ids=prompt["prompt_token_ids"],
                stream=False,
            )
        else:
            raise InvalidRequestError(
                "a prompt must be a string or a dict with 'prompt_token_ids'", "prompts"
            )
        return request_id

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(request_ids), desc="generating", disable=not use_tqdm or len(request_ids) < 2
        )
        try:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:
            self.engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]

    def stats(self) -> dict[str, Any]:
        """Engine counters (preemptions, prefix-cache tokens, KV blocks, ...)."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache; False (nothing done) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def check_kv_integrity(self) -> None:
        """Raise ``BlockPoolError`` if the KV blocks' bookkeeping is inconsistent (a bug)."""
        self.engine.check_kv_integrity()

    def kv_cache_info(self) -> KVCacheInfo:
        """The KV cache as allocated (the driver rank's, see ``LLMEngine.kv_cache_info``)."""
        return self.engine.kv_cache_info()

    def shutdown(self) -> None:
        """Release worker processes; needed only with tensor parallelism."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
