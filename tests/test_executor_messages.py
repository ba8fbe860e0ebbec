"""The typed calls a driver sends its worker ranks: what runs, what goes back, how they travel."""

from __future__ import annotations

import pickle

import pytest

from platform_core.executor.messages import (
    AllocateKVCache,
    Forward,
    PlanKVCache,
    RankReply,
    Shutdown,
    serve_call,
)


class RecordingRunner:
    """Stands in for a ModelRunner: records each method call and returns a marker."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def plan_kv_cache(self, max_useful_blocks, max_model_len, extra_bytes):
        self.calls.append(("plan_kv_cache", (max_useful_blocks, max_model_len, extra_bytes)))
        return "the plan"

    def allocate_kv_cache(self, num_blocks, max_model_len):
        self.calls.append(("allocate_kv_cache", (num_blocks, max_model_len)))

    def forward(self, plan):
        self.calls.append(("forward", (plan,)))
        return "logits"


def test_each_call_runs_its_method_with_its_arguments_in_order() -> None:
    runner = RecordingRunner()
    PlanKVCache(max_useful_blocks=7, max_model_len=64, extra_bytes_per_block=3).run(runner)
    AllocateKVCache(num_blocks=5, max_model_len=32).run(runner)
    assert Forward(plan="p").run(runner) == "logits"
    assert runner.calls == [
        ("plan_kv_cache", (7, 64, 3)),
        ("allocate_kv_cache", (5, 32)),
        ("forward", ("p",)),
    ]


def test_a_worker_returns_its_kv_plan_but_never_its_logits() -> None:
    runner = RecordingRunner()
    assert serve_call(runner, PlanKVCache(max_useful_blocks=1, max_model_len=8)) == "the plan"
    assert serve_call(runner, Forward(plan="p")) is None
    assert serve_call(runner, AllocateKVCache(num_blocks=2)) is None


def test_calls_are_keyword_only_and_survive_a_pipe() -> None:
    with pytest.raises(TypeError):
        PlanKVCache(7, 64)  # type: ignore[misc]
    for message in (
        PlanKVCache(max_useful_blocks=7, max_model_len=64),
        AllocateKVCache(num_blocks=3, max_model_len=None),
        Forward(plan=[1, 2]),
        Shutdown(),
        RankReply(error="Traceback ..."),
    ):
        assert pickle.loads(pickle.dumps(message)) == message
