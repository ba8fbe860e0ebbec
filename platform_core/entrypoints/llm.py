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
from platform_core.lora_request import LoRARequest
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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string or ``{"prompt_token_ids": [...]}`` (optionally with ``"prompt"``).
        ``sampling_params`` is one for all prompts or one per prompt; so is ``lora_request``,
        the adapter to run with (needs ``enable_lora=True``; None: the base model).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = self._params_for(len(prompts), sampling_params)
        loras = _one_per_prompt(len(prompts), lora_request, LoRARequest, "lora_request")
        request_ids = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras):
                request_ids.append(self._add(prompt, params, lora))
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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the chat template
        (``lora_request`` as in :meth:`generate`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt_token_ids": render_chat(
                    self.tokenizer, conversation, add_generation_prompt, chat_template
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:
        """The best ``params.beam_width`` beams of each prompt, in input order (every beam
        with the adapter ``lora_request``, if given).

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
                outputs = self.generate(
                    rounds, search.step_params, use_tqdm=False, lora_request=lora_request
                )
                search.advance(outputs)
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
            params = self.get_default_sampling_params()
        return _one_per_prompt(count, params, SamplingParams, "sampling_params")

    def _add(self, prompt: PromptType, params: SamplingParams, lora: LoRARequest | None) -> str:
        request_id = self.engine.new_request_id()
        # generate() returns final outputs only: the engine need not build one every step.
        if isinstance(prompt, str):
            self.engine.add_request(request_id, prompt, params, stream=False, lora_request=lora)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            self.engine.add_request(
                request_id,
                prompt.get("prompt"),
                params,
                prompt_token_ids=prompt["prompt_token_ids"],
                stream=False,
                lora_request=lora,
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


def _one_per_prompt(count: int, given: Any, single: type, name: str) -> list[Any]:
    """``given`` for each of ``count`` prompts: one value (or None) for all, or a sequence of
    exactly ``count``."""
    if given is None or isinstance(given, single):
        return [given] * count
    if len(given) != count:
        raise InvalidRequestError(f"got {len(given)} {name} for {count} prompts", name)
    return list(given)
