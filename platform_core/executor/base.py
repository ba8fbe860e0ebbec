"""The executor contract: run a step on every rank in lockstep, sample on the driver.

The driver's own ``ModelRunner`` is rank 0 and lives in the engine's process; other ranks run
the same ``forward(plan)`` wherever the executor placed them. Every method that runs the model
is collective: the executor sends it to all ranks before the driver runs its share.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from platform_core.config import EngineConfig
from platform_core.errors import PlatformCoreError
from platform_core.executor.messages import AllocateKVCache, Forward, PlanKVCache, RankCall
from platform_core.scheduler.output import ModelRunnerOutput, SchedulerOutput
from platform_core.worker.model_runner import KVCachePlan, ModelRunner


class WorkerDiedError(PlatformCoreError, RuntimeError):
    """A worker rank exited or failed; the engine cannot run steps any more."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything a rank needs to build its shard of the model; picklable."""

    config: EngineConfig
    model_dir: Path
    hf_config: Any
    dtype: torch.dtype
    eos_token_ids: frozenset[int]


class Executor(ABC):
    """Runs the model's ranks. ``driver`` is rank 0's runner (samples, owns the KV plan)."""

    driver: ModelRunner

    @abstractmethod
    def plan_kv_cache(
        self, max_useful_blocks: int, max_model_len: int, extra_bytes_per_block: int = 0
    ) -> KVCachePlan:
        """Size the KV cache on every rank; the smallest rank's block count wins."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int, max_model_len: int | None = None) -> None:
        """Allocate ``num_blocks`` on every rank (with ``max_model_len``: the serving cache,
        over which a backend may capture graphs)."""

    @abstractmethod
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; return the driver's sampled tokens."""

    def check_health(self) -> None:  # noqa: B027 - nothing to check with one process
        """Raise ``WorkerDiedError`` if a rank is gone."""

    def shutdown(self) -> None:  # noqa: B027 - nothing to stop with one process
        """Stop every worker; idempotent."""


class UniprocExecutor(Executor):
    """One rank, in the engine's process."""

    def __init__(self, spec: ModelSpec, backend: Any) -> None:
        self.driver = ModelRunner(
            spec.config, backend, spec.model_dir, spec.hf_config, spec.dtype, spec.eos_token_ids
        )

    def plan_kv_cache(
        self, max_useful_blocks: int, max_model_len: int, extra_bytes_per_block: int = 0
    ) -> KVCachePlan:
        return self.driver.plan_kv_cache(max_useful_blocks, max_model_len, extra_bytes_per_block)

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int | None = None) -> None:
        self.driver.allocate_kv_cache(num_blocks, max_model_len)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver.execute(output)


class LockstepExecutor(Executor):
    """Several ranks: each collective method goes to the workers, then runs on the driver.

    Subclasses supply the transport: ``_send`` a typed call to every worker and ``_gather`` one
    reply from each (raising ``WorkerDiedError`` for a dead, failed or silent worker).
    """

    @abstractmethod
    def _send(self, call: RankCall) -> None: ...

    @abstractmethod
    def _gather(self) -> list[Any]: ...

    def _call(self, call: RankCall) -> tuple[Any, list[Any]]:
        """Run ``call`` on every rank; the driver's result and the workers' replies."""
        self._send(call)
        try:
            mine = call.run(self.driver)
        except RuntimeError as exc:  # a collective whose peer died
            self.check_health()
            raise WorkerDiedError(f"a collective failed: {exc}") from exc
        return mine, self._gather()

    def plan_kv_cache(
        self, max_useful_blocks: int, max_model_len: int, extra_bytes_per_block: int = 0
    ) -> KVCachePlan:
        mine, theirs = self._call(
            PlanKVCache(
                max_useful_blocks=max_useful_blocks,
                max_model_len=max_model_len,
                extra_bytes_per_block=extra_bytes_per_block,
            )
        )
        smallest = min(p.num_blocks for p in [mine, *theirs])
        return dataclasses.replace(mine, num_blocks=smallest)

    def allocate_kv_cache(self, num_blocks: int, max_model_len: int | None = None) -> None:
        self._call(AllocateKVCache(num_blocks=num_blocks, max_model_len=max_model_len))

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        plan = self.driver.plan(output)
        logits, _ = self._call(Forward(plan=plan))
        return self.driver.step_sampler(output, plan, logits)


def destroy_process_group() -> None:
    """Leave the default process group, if this process joined one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
