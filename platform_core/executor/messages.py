"""The typed messages a driver sends to its worker ranks, and the reply each rank sends back.

Every collective the executor runs is one of these calls: a picklable record that knows how to run
itself on a rank's ``ModelRunner``. The driver runs the same record on its own runner, so a rank
can never be asked for a method that does not exist or with arguments in the wrong order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from platform_core.worker.model_runner import KVCachePlan, ModelRunner
    from platform_core.worker.step_plan import StepPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanKVCache:
    """Size the KV cache on a rank (``ModelRunner.plan_kv_cache``)."""

    max_useful_blocks: int
    max_model_len: int
    extra_bytes_per_block: int = 0
    result_to_driver: ClassVar[bool] = True

    def run(self, runner: ModelRunner) -> KVCachePlan:
        """Run on ``runner``; the rank's plan."""
        return runner.plan_kv_cache(
            self.max_useful_blocks, self.max_model_len, self.extra_bytes_per_block
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocateKVCache:
    """Allocate ``num_blocks`` on a rank (with ``max_model_len``: the serving cache)."""

    num_blocks: int
    max_model_len: int | None = None
    result_to_driver: ClassVar[bool] = False

    def run(self, runner: ModelRunner) -> None:
        """Run on ``runner``."""
        runner.allocate_kv_cache(self.num_blocks, self.max_model_len)


@dataclass(frozen=True, slots=True, kw_only=True)
class Forward:
    """One model forward over ``plan``; only the driver's logits are used (sampling is its job)."""

    plan: StepPlan
    result_to_driver: ClassVar[bool] = False

    def run(self, runner: ModelRunner) -> Any:
        """Run on ``runner``; the rank's logits."""
        return runner.forward(self.plan)


RankCall = PlanKVCache | AllocateKVCache | Forward


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Ask a worker process to exit its loop."""


@dataclass(frozen=True, slots=True)
class RankReply:
    """A worker's answer to one call: its result, or the traceback it raised."""

    value: Any = None
    error: str | None = None


def serve_call(runner: ModelRunner, call: RankCall) -> Any:
    """Run ``call`` on a worker's runner; what goes back to the driver (``None`` where unused)."""
    result = call.run(runner)
    return result if call.result_to_driver else None
