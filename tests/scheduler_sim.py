"""A model-free driver for the scheduler: every sampled token is a function of the sequence."""

from collections.abc import Callable

from platform_core.config import CacheConfig, SchedulerConfig
from platform_core.sampling_params import SamplingParams
from platform_core.scheduler.output import ModelRunnerOutput, SchedulerOutput
from platform_core.scheduler.request import Request
from platform_core.scheduler.scheduler import Scheduler


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    prefix_caching: bool = True,
    chunked_prefill: bool = True,
    max_loras: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs, max_num_batched_tokens, chunked_prefill),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_blocks,
        max_loras,
    )


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, n: int = 1) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n),
        max_tokens=max_tokens,
        pending_fork_ids=[f"{request_id}#{i}" for i in range(1, n)],
    )


def fake_token(token_ids: list[int]) -> int:
    return (sum(token_ids) * 31 + len(token_ids)) % 97


def run_step(
    scheduler: Scheduler, observe: Callable[[SchedulerOutput], None] | None = None
) -> tuple[SchedulerOutput, list[Request]]:
    """Schedule, 'execute' by the fake rule, update; return the step and who finished.

    ``observe`` sees the step's output before it runs (as the model runner would).
    """
    output = scheduler.schedule()
    if observe is not None:
        observe(output)
    sampled = {}
    for item in output.scheduled:
        if item.sample:
            request = scheduler.requests[item.request_id]
            token = fake_token(request.all_token_ids)
            for index, sample_id in enumerate([item.request_id, *item.fork_ids]):
                sampled[sample_id] = [token + index]
    finished = scheduler.update(output, ModelRunnerOutput(sampled=sampled))
    return output, finished
