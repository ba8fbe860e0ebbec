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
from platform_core.sample.metadata import GeneratorStore, build_sampling_metadata
from platform_core.sample.sampler import Sampler
from platform_core.sampling_params import SamplingParams
from platform_core.scheduler.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from platform_core.worker.input_builder import InputBuilder

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
        self.kv_caches: list[torch.Tensor] = []

    @property
    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def bytes_per_block(self) -> int:
        m = self.model
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * m.num_kv_heads * m.head_size * element * m.num_layers

    def plan_kv_cache(self, max_useful_blocks: int, max_model_len: int) -> KVCachePlan:
        """Size the KV cache: user override, else measured memory; never more than useful."""
        cache = self.config.cache
        report = None
        if cache.num_gpu_blocks_override is not None:
            budget, source = cache.num_gpu_blocks_override * self.bytes_per_block, "block override"
        elif cache.kv_cache_memory_bytes is not None:
            budget, source = cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        else:
            report = self.backend.memory.profile(
                lambda: self._dummy_forward(max_model_len), self.weights_bytes
            )
            budget = self.backend.memory.kv_cache_budget(report, cache.memory_utilization)
            source = "profiled"
        num_blocks = min(budget // self.bytes_per_block, max_useful_blocks)
        return KVCachePlan(num_blocks, self.bytes_per_block, budget, source, report)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate one zeroed cache tensor per layer in the backend's layout."""
        m = self.model
        shape = self.backend.attention.kv_cache_shape(
            num_blocks, self.block_size, m.num_kv_heads, m.head_size
        )
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.backend.device)
            for _ in range(m.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and sample the requests whose known tokens are now all computed."""
        self.generators.drop(output.finished_ids)
        model_input = self.input_builder.build(output)
        hidden = self.model(
            model_input.input_ids, model_input.positions, self.kv_caches, model_input.metadata
        )
        if not model_input.sample_requests:
            return ModelRunnerOutput(sampled={})
        logits = self.model.compute_logits(hidden[model_input.logits_indices])
        tokens = self.sample(logits, model_input.sample_requests)
        return ModelRunnerOutput(
            sampled={r.request_id: t for r, t in zip(model_input.sample_requests, tokens)}
        )

    def sample(self, logits: torch.Tensor, requests: list[ScheduledRequest]) -> list[int]:
        metadata = build_sampling_metadata(requests, self.generators, logits.device)
        return self.sampler(logits, metadata).tolist()

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
