"""Runs the model for one step: build inputs, forward, compute logits, sample.

The runner owns the model, the KV-cache tensors and the sampler; the scheduler owns which tokens
run. Everything device-specific comes from the backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from platform_core.config import EngineConfig
from platform_core.plugins.interfaces import Backend, MemoryReport
from platform_core.sample.metadata import GeneratorStore, SampleRow, build_sampling_metadata
from platform_core.sample.sampler import Sampler, compute_logprobs
from platform_core.sampling_params import SamplingParams
from platform_core.scheduler.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from platform_core.spec.verify import DraftGroup, verify
from platform_core.worker.input_builder import InputBuilder, ModelInput
from platform_core.worker.kv_tensors import allocate_kv_caches, kv_bytes_per_block

logger = logging.getLogger("platform_core.worker")


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """How the KV cache was sized, for logs and stats."""

    num_blocks: int
    bytes_per_block: int
    budget_bytes: int
    source: str
    memory: MemoryReport | None


class ModelRunner:
    """Holds the model and its KV cache on the backend's device."""

    def __init__(
        self,
        config: EngineConfig,
        backend: Backend,
        model_dir: Path,
        hf_config: Any,
        dtype: torch.dtype,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        from platform_core.models.loader import load_model

        self.config = config
        self.backend = backend
        self.dtype = dtype
        self.model = load_model(
            model_dir, hf_config, dtype, backend.device, backend.attention, backend.op_overrides()
        )
        self.block_size = config.cache.block_size
        self.input_builder = InputBuilder(self.block_size, backend.device)
        engine_generator = torch.Generator()
        engine_generator.manual_seed(config.model.seed)
        self.sampler = Sampler(engine_generator)
        self.generators = GeneratorStore()
        self.eos_token_ids = eos_token_ids
        self.kv_caches: list[torch.Tensor] = []

    @property
    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model, self.block_size, self.dtype)

    def plan_kv_cache(
        self, max_useful_blocks: int, max_model_len: int, extra_bytes_per_block: int = 0
    ) -> KVCachePlan:
        """Size the KV cache: user override, else measured memory; never more than useful.

        ``extra_bytes_per_block`` is what other caches indexed by the same block ids (a draft
        model's) need per block.
        """
        cache = self.config.cache
        per_block = self.bytes_per_block + extra_bytes_per_block
        report = None
        if cache.num_gpu_blocks_override is not None:
            budget, source = cache.num_gpu_blocks_override * per_block, "block override"
        elif cache.kv_cache_memory_bytes is not None:
            budget, source = cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        else:
            report = self.backend.memory.profile(
                lambda: self._dummy_forward(max_model_len), self.weights_bytes
            )
            budget = self.backend.memory.kv_cache_budget(report, cache.memory_utilization)
            source = "profiled"
        num_blocks = min(budget // per_block, max_useful_blocks)
        return KVCachePlan(num_blocks, per_block, budget, source, report)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate one zeroed cache tensor per layer in the backend's layout."""
        self.kv_caches = allocate_kv_caches(
            self.backend.attention,
            self.model,
            num_blocks,
            self.block_size,
            self.dtype,
            self.backend.device,
        )

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: block copies, forward, then sampling and logprobs."""
        self.generators.drop(output.finished_ids)
        if output.block_copies:
            self._copy_blocks(output.block_copies)
        model_input = self.input_builder.build(output)
        hidden = self.model(
            model_input.input_ids, model_input.positions, self.kv_caches, model_input.metadata
        )
        result = ModelRunnerOutput()
        self._prompt_logprobs(output, model_input, hidden, result)
        if model_input.sample_requests:
            self._sample(model_input, hidden, result)
        return result

    def _sample(self, model_input: ModelInput, hidden: torch.Tensor, result: ModelRunnerOutput):
        """Sample every request's next token(s): forks share a row, drafts are verified."""
        rows: list[SampleRow] = []
        logits_rows: list[int] = []
        groups: list[DraftGroup] = []
        position = 0
        for request in model_input.sample_requests:
            drafts = request.draft_token_ids
            history = request.output_token_ids
            ids = [request.request_id, *request.fork_ids]
            for index, request_id in enumerate(ids):
                params = request.sampling_params
                params = params.clone_for_sample(index) if index else params
                groups.append(DraftGroup(len(rows), drafts, request.draft_probs))
                for i in range(len(drafts) + 1):
                    tokens_before = history if not i else history + drafts[:i]
                    rows.append(
                        SampleRow(request_id, params, request.prompt_token_ids, tokens_before)
                    )
                    logits_rows.append(position + i)
            position += len(drafts) + 1
        logits = self.model.compute_logits(hidden[model_input.logits_indices])
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(logits_rows, device=logits.device)]
        meta = build_sampling_metadata(rows, self.generators, self.eos_token_ids, logits.device)
        if any(group.drafts for group in groups):
            accepted = verify(self.sampler, logits, meta, groups)
        else:
            accepted = [[token] for token in self.sampler(logits, meta).token_ids]
        row_tokens = [0] * len(rows)
        for group, tokens in zip(groups, accepted):
            row_tokens[group.first : group.first + len(tokens)] = tokens
        logprobs = self.sampler.logprobs(logits, row_tokens, meta)
        for group, tokens in zip(groups, accepted):
            request_id = rows[group.first].request_id
            result.sampled[request_id] = tokens
            if logprobs[group.first] is not None:
                result.logprobs[request_id] = logprobs[group.first : group.first + len(tokens)]

    def _prompt_logprobs(
        self,
        output: SchedulerOutput,
        model_input: ModelInput,
        hidden: torch.Tensor,
        result: ModelRunnerOutput,
    ) -> None:
        """Logprobs of each computed prompt token given the tokens before it."""
        starts = model_input.metadata.query_start_loc_cpu
        for i, request in enumerate(output.scheduled):
            count = request.sampling_params.prompt_logprobs
            prompt = request.prompt_token_ids
            # Row p predicts token p + 1; only rows whose target is still a prompt token count.
            last_row_position = min(request.seq_len, len(prompt) - 1)
            if count is None or request.start_position >= last_row_position:
                continue
            num_rows = last_row_position - request.start_position
            rows = hidden[starts[i] : starts[i] + num_rows]
            targets = prompt[request.start_position + 1 : request.start_position + 1 + num_rows]
            logits = self.model.compute_logits(rows)
            target_t = torch.tensor(targets, device=logits.device)
            entries = compute_logprobs(logits, target_t, [count] * num_rows)
            result.prompt_logprobs[request.request_id] = (request.start_position + 1, entries)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        device = self.backend.device
        src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=device)
        for kv_cache in self.kv_caches:
            self.backend.attention.copy_blocks(kv_cache, src, dst)

    @torch.inference_mode()
    def _dummy_forward(self, max_model_len: int) -> None:
        """One forward over a full token budget, for peak-memory profiling.

        The budget is split into sequences no longer than the model's context.
        """
        remaining = self.config.scheduler.max_num_batched_tokens
        dummies, next_block = [], 0
        while remaining > 0:
            length = min(remaining, max_model_len)
            num_blocks = -(-length // self.block_size)
            dummies.append(
                ScheduledRequest(
                    request_id=f"__profile_{len(dummies)}__",
                    token_ids=[0] * length,
                    start_position=0,
                    block_ids=list(range(next_block, next_block + num_blocks)),
                    sample=True,
                    sampling_params=SamplingParams(temperature=0.0),
                )
            )
            next_block += num_blocks
            remaining -= length
        saved, self.kv_caches = self.kv_caches, []
        self.allocate_kv_cache(next_block)
        try:
            self.execute(SchedulerOutput(scheduled=dummies))
        finally:
            self.kv_caches = saved
