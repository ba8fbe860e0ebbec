"""Draft-model proposals: a smaller model of the same tokenizer proposes ``k`` tokens.

The draft model's KV cache lives in the same paged pool as the target's: its per-layer cache
tensors are indexed by the same block ids, so a request's block table serves both models and the
pool's accounting covers both. The draft keeps its own count of tokens whose draft K/V are valid
and catches up on the rest before proposing; it never trusts blocks it did not write itself.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from platform_core.config import EngineConfig
from platform_core.errors import ConfigError
from platform_core.kv_cache.manager import KVCacheManager
from platform_core.layers.ops import resolve_ops
from platform_core.plugins.interfaces import Backend
from platform_core.sample.metadata import GeneratorStore
from platform_core.sampling_params import SamplingParams
from platform_core.scheduler.output import ScheduledRequest, SchedulerOutput
from platform_core.scheduler.request import Request
from platform_core.worker.input_builder import InputBuilder
from platform_core.worker.kv_tensors import allocate_kv_caches, kv_bytes_per_block

logger = logging.getLogger("platform_core.speculative")


class DraftModelProposer:
    """Runs the draft model autoregressively for every decoding request in one batch per token."""

    def __init__(self, config: EngineConfig, backend: Backend, dtype: torch.dtype, vocab: int):
        from platform_core.models.hf_files import load_hf_config
        from platform_core.models.loader import load_model
        from platform_core.models.resolve import resolve_model_path

        spec = config.speculative
        self.num_tokens = spec.num_speculative_tokens
        self.block_size = config.cache.block_size
        self.backend = backend
        self.dtype = dtype
        model_dir = resolve_model_path(spec.draft_model)
        hf_config = load_hf_config(model_dir, config.model.trust_remote_code)
        overrides = backend.op_overrides()
        self.model = load_model(
            model_dir, hf_config, dtype, backend.device, backend.attention, overrides
        )
        self.argmax = resolve_ops(overrides).argmax  # the backend's row argmax, as the sampler's
        if self.model.vocab_size != vocab:
            raise ConfigError(
                f"the draft model's vocabulary ({self.model.vocab_size}) differs from the "
                f"target's ({vocab}); a draft model must share the target's tokenizer"
            )
        self.input_builder = InputBuilder(self.block_size, backend.device)
        self.generators = GeneratorStore()
        self.kv_caches: list[torch.Tensor] = []
        self._computed: dict[str, int] = {}
        logger.info("draft model %s proposes %d tokens per step", model_dir, self.num_tokens)

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model, self.block_size, self.dtype)

    def allocate(self, num_blocks: int) -> None:
        """Allocate the draft cache for the same block ids as the target's."""
        self.kv_caches = allocate_kv_caches(
            self.backend.attention,
            self.model,
            num_blocks,
            self.block_size,
            self.dtype,
            self.backend.device,
        )

    @torch.inference_mode()
    def propose(self, requests: list[Request], limits: list[int], kv: KVCacheManager) -> None:
        """Set ``spec_token_ids`` (and ``spec_draft_probs``) of each request that can draft.

        Blocks for the next step's ``1 + k`` tokens are claimed now (the scheduler then finds
        them held); a request whose blocks cannot be claimed gets no drafts.
        """
        live = {r.request_id for r in requests}
        self._computed = {k: v for k, v in self._computed.items() if k in live}
        self.generators.retain(live)
        self.input_builder.retain(live)
        active: list[tuple[Request, int]] = []
        for request, limit in zip(requests, limits):
            count = min(limit, self.num_tokens)
            if count > 0 and kv.allocate_slots(request, 1 + count):
                active.append((request, count))
        if not active:
            return
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in active}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in active}
        items = [self._catch_up_item(r, kv) for r, _ in active]
        for step in range(max(count for _, count in active)):
            logits = self._forward(items)
            greedy_tokens = self.argmax(logits).tolist()
            next_items = []
            for (request, count), item, row, greedy in zip(active, items, logits, greedy_tokens):
                if step >= count:
                    continue
                token, q = self._pick(request, row, greedy)
                drafts[request.request_id].append(token)
                probs[request.request_id].append(q)
                self._computed[request.request_id] = item.seq_len
                if step + 1 < count:
                    next_items.append(self._decode_item(request, item.seq_len, token, kv))
            active = [(r, c) for r, c in active if c > step + 1]
            items = next_items
        for request_id, tokens in drafts.items():
            request = next(r for r in requests if r.request_id == request_id)
            request.spec_token_ids = tokens
            request.spec_draft_probs = (
                None if request.sampling_params.greedy else torch.stack(probs[request_id])
            )

    def _catch_up_item(self, request: Request, kv: KVCacheManager) -> ScheduledRequest:
        # Only tokens the target has computed (or is about to) can have valid draft K/V.
        start = min(self._computed.get(request.request_id, 0), request.num_computed_tokens)
        return self._item(request, request.token_ids_slice(start, request.num_tokens), start, kv)

    def _decode_item(
        self, request: Request, position: int, token: int, kv: KVCacheManager
    ) -> ScheduledRequest:
        return self._item(request, [token], position, kv)

    @staticmethod
    def _item(
        request: Request, tokens: list[int], start: int, kv: KVCacheManager
    ) -> ScheduledRequest:
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tokens,
            start_position=start,
            block_ids=kv.block_ids(request.request_id),
            sample=True,
            sampling_params=_GREEDY,
        )

    def _forward(self, items: list[ScheduledRequest]) -> torch.Tensor:
        model_input = self.input_builder.build(SchedulerOutput(scheduled=items))
        hidden = self.model(
            model_input.input_ids, model_input.positions, self.kv_caches, model_input.metadata
        )
        return self.model.compute_logits(hidden[model_input.logits_indices])

    def _pick(self, request: Request, logits: torch.Tensor, greedy: int) -> tuple[int, Any]:
        """The draft token and the distribution it was drawn from (``None`` when greedy, whose
        token is ``greedy``, the row's argmax)."""
        params = request.sampling_params
        if params.greedy:
            return greedy, None
        q = torch.softmax(logits.float() / params.temperature, dim=-1)
        generator = self.generators.get(request.request_id, params.seed)
        token = int(torch.multinomial(q, 1, generator=generator))
        return token, q


_GREEDY = SamplingParams(temperature=0.0)
