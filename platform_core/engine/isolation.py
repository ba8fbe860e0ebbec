"""Running a step so that one bad request cannot take the batch down with it.

When a batched step raises, each request is re-run alone (re-writing the same K/V slots with the
same values is harmless), and only the requests that still fail are reported as failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from platform_core.executor.base import Executor, WorkerDiedError
from platform_core.scheduler.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("platform_core.engine")

FaultCheck = Callable[[str, list[str]], None]


def _run(executor: Executor, output: SchedulerOutput, check: FaultCheck | None):
    if check is not None:
        check("execute", [r.request_id for r in output.scheduled])
    return executor.execute(output)


def execute_isolated(
    executor: Executor, output: SchedulerOutput, check: FaultCheck | None = None
) -> tuple[ModelRunnerOutput, dict[str, str]]:
    """The step's results, and ``request id -> error`` for requests that failed alone."""
    try:
        return _run(executor, output, check), {}
    except WorkerDiedError:
        raise
    except Exception as exc:  # isolate below; a persistent failure is reported per request
        if len(output.scheduled) == 1:
            return ModelRunnerOutput(), {output.scheduled[0].request_id: _describe(exc)}
        logger.warning("a batched step failed (%s); re-running its requests one by one", exc)
    merged = ModelRunnerOutput()
    failed: dict[str, str] = {}
    for item in output.scheduled:
        single = SchedulerOutput(
            scheduled=[item],
            finished_ids=output.finished_ids,
            block_copies=output.block_copies,
        )
        try:
            result = _run(executor, single, check)
        except WorkerDiedError:
            raise
        except Exception as exc:
            failed[item.request_id] = _describe(exc)
            continue
        merged.sampled.update(result.sampled)
        merged.logprobs.update(result.logprobs)
        merged.prompt_logprobs.update(result.prompt_logprobs)
    return merged, failed


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
