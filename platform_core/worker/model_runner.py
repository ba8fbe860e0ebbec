"""Runs the model for one step: plan, forward (every rank), sample (the driver).

The runner owns the model, the KV-cache tensors and the sampler; the scheduler owns which tokens
run. Everything device-specific comes from the backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from platform_core.config import EngineConfig
from platform_core.kv_transfer.cache_access import BackendKVCache, kv_layout
from platform_core.kv_transfer.interfaces import KVConnectorWorker
from platform_core.kv_transfer.registry import KVConnectorRegistry
from platform_core.layers.ops import resolve_ops
from platform_core.lora.slots import LoRASlotTable
from platform_core.lora.worker import WorkerLoRA
from platform_core.models.quantized_weights import quantized_layers, quantized_summary
from platform_core.plugins.interfaces import Backend, MemoryReport
from platform_core.sampling_params import SamplingParams
from platform_core.scheduler.output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from platform_core.worker.input_builder import InputBuilder
from platform_core.worker.kv_tensors import KVCacheInfo, allocate_kv_caches, kv_bytes_per_block
from platform_core.worker.sampling_step import StepSampler
from platform_core.worker.step_plan import StepPlan, make_step_plan

if TYPE_CHECKING:
    from platform_core.distributed.parallel_state import TPGroup

logger = logging.getLogger("platform_core.worker")

#: Longest dummy sequence of the memory-profiling forward.
PROFILE_SEQ_LEN = 512


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
        tp: TPGroup | None = None,
    ) -> None:
        from platform_core.models.loader import load_model

        self.config = config
        self.backend = backend
        self.dtype = dtype
        overrides = backend.op_overrides()
        self.model = load_model(
            model_dir,
            hf_config,
            dtype,
            backend.device,
            backend.attention,
            overrides,
            **({} if tp is None else {"tp": tp}),
            quantization=config.model.quantization,
        )
        self.block_size = config.cache.block_size
        self.input_builder = InputBuilder(self.block_size, backend.device)
        ops = resolve_ops(overrides)
        #: this rank's adapter slots, and (used on the driver) which adapter each slot holds
        self.lora: WorkerLoRA | None = None
        self.lora_slots: LoRASlotTable | None = None
        if config.lora.enable_lora:
            self.lora = WorkerLoRA(self.model, hf_config, config.lora, dtype, backend.device, ops)
            self.lora_slots = LoRASlotTable(config.lora.max_loras)
        self.step_sampler = StepSampler(
            config.model.seed, eos_token_ids, ops.argmax, ops.apply_token_bitmask
        )
        self.kv_caches: list[torch.Tensor] = []
        self.num_kv_blocks = 0
        #: the backend's graph runner wrapping the model's forward, when it made one
        self.graph_runner: Callable[..., torch.Tensor] | None = None
        #: the KV connector's worker side, once the serving cache is allocated
        self.kv_connector: KVConnectorWorker | None = None

    @property
    def weights_bytes(self) -> int:
        """The model's parameters and, with LoRA, its adapter slots."""
        slots = 0 if self.lora is None else self.lora.slot_bytes
        return slots + sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def parameter_count(self) -> int:
        """The model's weights, counting each quantized one by its values, not its bytes."""
        return sum(p.numel() for p in self.model.parameters()) + sum(
            m.weight.shape[0] * m.quant.in_features(m.weight.shape[1]) - m.weight.numel()
            for m in quantized_layers(self.model)
            if m.quant
        )

    @property
    def quantization(self) -> str | None:
        """``"quantized Q4_1 x 120, Q8_0 x 1"``, or None when no weight is kept quantized."""
        return quantized_summary(self.model)

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

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int | None = None) -> None:
        """Allocate one zeroed cache tensor per layer in the backend's layout.

        With ``max_model_len`` this is the serving cache: the backend may then capture graphs
        of the forward over it (``Backend.graph_runner``).
        """
        self.kv_caches = allocate_kv_caches(
            self.backend.attention,
            self.model,
            num_blocks,
            self.block_size,
            self.dtype,
            self.backend.device,
        )
        self.num_kv_blocks = num_blocks
        self.graph_runner = None
        # A trace would fix whether a step has adapters: with LoRA every step runs eagerly.
        if max_model_len is not None and self.lora is None:
            self.graph_runner = self.backend.graph_runner(
                self.model, self.kv_caches, self.config, max_model_len
            )
        transfer = self.config.kv_transfer.kv_transfer_config
        if max_model_len is not None and transfer is not None:
            self.kv_connector = KVConnectorRegistry().create_worker(transfer)
            model = self.model
            layout = kv_layout(
                model.num_layers, self.block_size, model.num_kv_heads, model.head_size, self.dtype
            )
            access = BackendKVCache(self.backend.attention, self.kv_caches, layout)
            self.kv_connector.register_kv_caches(access)

    def kv_cache_info(self) -> KVCacheInfo:
        """This rank's KV cache (no blocks before ``allocate_kv_cache``)."""
        return KVCacheInfo(
            num_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            bytes_per_block=self.bytes_per_block,
            allocated_bytes=sum(t.numel() * t.element_size() for t in self.kv_caches),
            devices=tuple(dict.fromkeys(t.device for t in self.kv_caches)),
        )

    def plan(self, output: SchedulerOutput) -> StepPlan:
        """The step every rank runs (made on the driver)."""
        plan = make_step_plan(output, self.input_builder, self.lora_slots)
        if self.lora is not None:
            self.lora.prepare(plan.lora)
        return plan

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Block copies, the forward pass and the planned rows' logits (in the model's dtype).

        Collective under tensor parallelism: every rank calls it with the same plan.
        """
        self.backend.before_step()
        if plan.block_copies:
            self._copy_blocks(plan.block_copies)
        if self.lora is not None:
            self.lora.activate(plan.lora)
        model_input = self.input_builder.to_device(plan.batch)
        step_forward = self.model if self.graph_runner is None else self.graph_runner
        hidden = step_forward(
            model_input.input_ids, model_input.positions, self.kv_caches, model_input.metadata
        )
        rows = torch.from_numpy(plan.logits_rows).to(hidden.device)
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Plan, forward and sample one step in this process, with the KV connector's work
        around the forward pass (a step may be the connector's alone: nothing scheduled)."""
        connector, metadata = self.kv_connector, output.kv_connector_metadata
        if connector is None or metadata is None:
            plan = self.plan(output)
            return self.step_sampler(output, plan, self.forward(plan))
        connector.start_load_kv(metadata)
        result = ModelRunnerOutput()
        if output.scheduled:
            plan = self.plan(output)
            result = self.step_sampler(output, plan, self.forward(plan))
        connector.save_kv(metadata)
        result.kv_connector = connector.get_finished()
        return result

    def shutdown(self) -> None:
        """Stop the KV connector's worker side (its sockets and threads), if any."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        device = self.backend.device
        src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=device)
        for kv_cache in self.kv_caches:
            self.backend.attention.copy_blocks(kv_cache, src, dst)

    @torch.inference_mode()
    def _dummy_forward(self, max_model_len: int) -> None:
        """One forward over a full token budget, for peak-memory profiling.

        The budget is split into sequences of at most ``PROFILE_SEQ_LEN`` tokens (and the
        model's context): the activations' peak depends on the token count, while one long
        sequence would only make the paged-attention kernels, which keep no score matrix,
        slow to profile.
        """
        remaining = self.config.scheduler.max_num_batched_tokens
        dummies, next_block = [], 0
        while remaining > 0:
            length = min(remaining, max_model_len, PROFILE_SEQ_LEN)
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
        saved = self.kv_caches, self.num_kv_blocks
        self.kv_caches = []
        self.allocate_kv_cache(next_block)
        try:
            self.execute(SchedulerOutput(scheduled=dummies))
        finally:
            self.kv_caches, self.num_kv_blocks = saved
            self.input_builder.release([d.request_id for d in dummies])
