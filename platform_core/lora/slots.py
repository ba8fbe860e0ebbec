"""Which adapter each layer slot holds: chosen once per step on the driver, sent to every rank."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from platform_core.lora_request import LoRARequest


@dataclass(slots=True)
class StepLoRA:
    """One step's adapters as plain data: ``adapters`` maps each slot the step uses to the
    adapter it must hold; ``token_slots`` (``[T]`` int32) is each token's slot, -1 for the base
    model; ``segments`` the ``(start, end, slot)`` runs of tokens with an adapter."""

    adapters: dict[int, LoRARequest]
    token_slots: np.ndarray
    segments: tuple[tuple[int, int, int], ...]


class LoRASlotTable:
    """The driver's record of the adapter in each of ``max_loras`` slots.

    A step's adapters keep the slots they hold; an adapter without one takes a free slot, else
    the least recently used slot no adapter of the step holds. Every rank then loads the same
    adapter into the same slot.
    """

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first

    def plan(
        self, adapters: Sequence[LoRARequest | None], num_tokens: Sequence[int]
    ) -> StepLoRA | None:
        """The step of requests running with ``adapters`` over ``num_tokens`` tokens each, in
        batch order; ``None`` when no request of the step has an adapter."""
        used = {a.lora_int_id: a for a in adapters if a is not None}
        if not used:
            return None
        if len(used) > self.max_loras:
            raise RuntimeError(
                f"{len(used)} adapters in one step, but the layers hold {self.max_loras} "
                "(the scheduler admits at most max_loras)"
            )
        slots = {lora_id: self._slot_for(lora_id, used) for lora_id in used}
        per_request = np.array(
            [-1 if a is None else slots[a.lora_int_id] for a in adapters], dtype=np.int32
        )
        counts = np.asarray(num_tokens, dtype=np.int64)
        ends = np.cumsum(counts)
        segments = tuple(
            (int(end - count), int(end), int(slot))
            for slot, count, end in zip(per_request, counts, ends, strict=True)
            if slot >= 0 and count > 0
        )
        return StepLoRA(
            adapters={slots[i]: a for i, a in used.items()},
            token_slots=np.repeat(per_request, counts),
            segments=_merge_runs(segments),
        )

    def _slot_for(self, lora_id: int, used: dict[int, LoRARequest]) -> int:
        slot = self._slot_of.get(lora_id)
        if slot is not None:
            self._slot_of.move_to_end(lora_id)
            return slot
        taken = set(self._slot_of.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self._slot_of if i not in used)
            slot = self._slot_of.pop(victim)
        self._slot_of[lora_id] = slot
        return slot


def _merge_runs(segments: tuple[tuple[int, int, int], ...]) -> tuple[tuple[int, int, int], ...]:
    """Adjacent segments of the same slot as one."""
    merged: list[tuple[int, int, int]] = []
    for start, end, slot in segments:
        if merged and merged[-1][1] == start and merged[-1][2] == slot:
            merged[-1] = (merged[-1][0], end, slot)
        else:
            merged.append((start, end, slot))
    return tuple(merged)
