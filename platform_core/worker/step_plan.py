"""What every rank runs in one step, as plain data: the batch and which rows need logits.

The driver makes the plan from the scheduler's output; every rank (the driver included) runs the
same forward pass and logits computation on it, in lockstep, because tensor-parallel layers
communicate. Only the driver samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from platform_core.lora.slots import LoRASlotTable, StepLoRA
from platform_core.scheduler.output import SchedulerOutput
from platform_core.worker.input_builder import HostBatch, InputBuilder


@dataclass(slots=True)
class PromptLogprobRows:
    """Rows ``offset .. offset + count`` of the step's logits score prompt tokens
    ``first_target .. first_target + count`` of scheduled request ``request_index``."""

    request_index: int
    first_target: int
    count: int
    offset: int


@dataclass(slots=True)
class StepPlan:
    """One step for all ranks: the batch, block copies, and the rows to compute logits for.

    ``logits_rows`` lists the sampling rows first (``num_sample_rows`` of them), then the rows of
    each ``prompt_rows`` entry. ``lora`` gives the adapter slots of the step's tokens (None
    when no request of the step has an adapter).
    """

    batch: HostBatch
    block_copies: list[tuple[int, int]]
    logits_rows: np.ndarray
    num_sample_rows: int
    prompt_rows: list[PromptLogprobRows]
    lora: StepLoRA | None = None


def make_step_plan(
    output: SchedulerOutput, builder: InputBuilder, lora_slots: LoRASlotTable | None = None
) -> StepPlan:
    """Plan the step: build the batch, add prompt-logprob rows where they are asked for, and
    place the step's adapters in ``lora_slots`` (with LoRA enabled)."""
    batch = builder.build_host(output)
    rows = [batch.logits_indices]
    prompt_rows = []
    offset = len(batch.logits_indices)
    for i, request in enumerate(output.scheduled):
        if request.sampling_params.prompt_logprobs is None:
            continue
        # Row p predicts token p + 1; only rows whose target is still a prompt token count.
        last_position = min(request.seq_len, len(request.prompt_token_ids) - 1)
        count = last_position - request.start_position
        if count <= 0:
            continue
        start = int(batch.query_start_loc[i])
        rows.append(np.arange(start, start + count, dtype=np.int64))
        prompt_rows.append(PromptLogprobRows(i, request.start_position + 1, count, offset))
        offset += count
    return StepPlan(
        batch=batch,
        block_copies=list(output.block_copies),
        logits_rows=np.concatenate(rows) if len(rows) > 1 else batch.logits_indices,
        num_sample_rows=len(batch.logits_indices),
        prompt_rows=prompt_rows,
        lora=None if lora_slots is None else _plan_lora(output, lora_slots),
    )


def _plan_lora(output: SchedulerOutput, lora_slots: LoRASlotTable) -> StepLoRA | None:
    scheduled = output.scheduled
    return lora_slots.plan([r.lora_request for r in scheduled], [r.num_tokens for r in scheduled])
