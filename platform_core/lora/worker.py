"""A rank's adapters: slots attached to its model, adapters cached in host memory."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from platform_core.config import LoRAConfig
from platform_core.layers.lora_mapping import LoRAMapping, LoRASegment
from platform_core.layers.ops import LayerOps
from platform_core.lora.layers import LinearLoRA, attach_lora
from platform_core.lora.peft_adapter import LoRAAdapter, load_adapter
from platform_core.lora.slots import StepLoRA
from platform_core.lora_request import LoRARequest

logger = logging.getLogger("platform_core.lora")


class WorkerLoRA:
    """Loads each step's adapters into the model's slots and sets the step's mapping.

    Adapters read from disk stay in host memory, up to ``max_cpu_loras`` of them (least
    recently used dropped first); a slot is rewritten only when the step wants another adapter
    in it than the one it holds.
    """

    def __init__(
        self,
        model: nn.Module,
        hf_config: Any,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
        ops: LayerOps,
    ) -> None:
        self.config = config
        self._hf_config = hf_config
        self._device = device
        self.state, self.layers = attach_lora(
            model, config.max_loras, config.max_lora_rank, dtype, ops.lora_shrink, ops.lora_expand
        )
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slot_ids: list[int | None] = [None] * config.max_loras
        logger.info(
            "LoRA: %d adapter slots of rank up to %d (%.1f MB), %d adapters kept in host memory",
            config.max_loras,
            config.max_lora_rank,
            self.slot_bytes / 1e6,
            config.cpu_capacity,
        )

    @property
    def slot_bytes(self) -> int:
        """Device memory of every layer's slots."""
        return sum(lora.nbytes for loras in self.layers.values() for lora in loras)

    @property
    def loaded_ids(self) -> list[int]:
        """Ids of the adapters in host memory, least recently used first."""
        return list(self._host)

    def prepare(self, step: StepLoRA | None) -> None:
        """Read the adapters ``step`` must write into slots (on the driver, while planning):
        an adapter that cannot be read then fails the step before any rank runs it, and
        only the requests that need it fail when the engine re-runs them one by one."""
        for slot, request in ({} if step is None else step.adapters).items():
            if self._slot_ids[slot] != request.lora_int_id:
                self._adapter(request)

    def activate(self, step: StepLoRA | None) -> None:
        """Make the slots hold ``step``'s adapters and point the layers at its mapping."""
        if step is None:
            self.state.mapping = None
            return
        for slot, request in step.adapters.items():
            if self._slot_ids[slot] != request.lora_int_id:
                adapter = self._adapter(request)
                self._slot_ids[slot] = None  # a write that fails midway leaves no adapter
                self._write(slot, adapter)
                self._slot_ids[slot] = request.lora_int_id
        self.state.mapping = LoRAMapping(
            token_slots=torch.from_numpy(step.token_slots).to(self._device),
            segments=tuple(LoRASegment(*segment) for segment in step.segments),
            max_slots=self.config.max_loras,
        )

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._host.get(request.lora_int_id)
        if adapter is not None:
            self._host.move_to_end(request.lora_int_id)
            return adapter
        started = time.perf_counter()
        adapter = load_adapter(request, self._hf_config, self.config.max_lora_rank)
        logger.info(
            "loaded LoRA adapter %r (id %d, rank %d, %.1f MB) in %.0f ms",
            request.lora_name,
            request.lora_int_id,
            adapter.config.rank,
            adapter.nbytes / 1e6,
            (time.perf_counter() - started) * 1e3,
        )
        self._host[request.lora_int_id] = adapter
        while len(self._host) > self.config.cpu_capacity:
            self._host.popitem(last=False)
        return adapter

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer_index, loras in self.layers.items():
            for lora in loras:
                lora.write_slot(slot, _weights_of(adapter, layer_index, lora))


def _weights_of(
    adapter: LoRAAdapter, layer_index: int, lora: LinearLoRA
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    found = {}
    for part in lora.parts:
        weights = adapter.weights.get((layer_index, part))
        if weights is not None:
            found[part] = weights
    return found
