"""Engine reliability: failures stay with their request, deadlines, back-pressure, abort storms."""

from __future__ import annotations

import random
import time

import pytest

from platform_core import LLM, SamplingParams
from platform_core.engine.faults import FaultInjector
from platform_core.errors import QueueFullError
from platform_core.scheduler.request import RequestStatus

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(
        str(tiny_model_dir("llama")), dtype="float32", num_gpu_blocks_override=64, block_size=16
    )


def run_all(engine) -> dict[str, object]:
    finals = {}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def assert_clean(llm: LLM) -> None:
    llm.check_kv_integrity()
    assert llm.stats()["kv_blocks_used"] == 0
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("stage", ["execute", "postprocess"])
def test_injected_fault_fails_only_its_request(llm, stage):
    engine = llm.engine
    prompts = {f"{stage}-{i}": [3 + i, 4 + i, 5 + i, 6 + i] for i in range(5)}
    baseline = {
        rid: o.outputs[0].token_ids
        for rid, o in zip(
            prompts,
            llm.generate(
                [{"prompt_token_ids": p} for p in prompts.values()], GREEDY, use_tqdm=False
            ),
        )
    }
    engine.faults = FaultInjector()
    victim = f"{stage}-2"
    engine.faults.fail(victim, stage)
    try:
        for rid, prompt in prompts.items():
            engine.add_request(rid, None, GREEDY, prompt_token_ids=prompt)
        finals = run_all(engine)
    finally:
        engine.faults = None
    assert finals[victim].error and "injected fault" in finals[victim].error
    assert finals[victim].outputs[0].finish_reason == "error"
    for rid in prompts:
        if rid != victim:
            assert finals[rid].error is None
            assert finals[rid].outputs[0].token_ids == baseline[rid]
    assert_clean(llm)


def test_invalid_token_reaching_the_model_is_isolated(llm):
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"tok-{i}", None, GREEDY, prompt_token_ids=[7, 8, 9])
    # Corrupt one request after validation, as a bug upstream would.
    engine.scheduler.requests["tok-1"].prompt_token_ids[1] = engine.vocab_size + 10
    finals = run_all(engine)
    assert finals["tok-1"].error is not None
    assert finals["tok-0"].error is None and len(finals["tok-0"].outputs[0].token_ids) == 6
    assert finals["tok-2"].outputs[0].token_ids == finals["tok-0"].outputs[0].token_ids
    assert_clean(llm)


def test_deadline_aborts_and_frees(llm):
    engine = llm.engine
    slow = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    engine.add_request(
        "late", None, slow, prompt_token_ids=[5] * 20, deadline=time.monotonic() + 0.2
    )
    engine.add_request("fine", None, GREEDY, prompt_token_ids=[6] * 20)
    assert not any(o.finished for o in engine.step())  # the first tokens, inside the deadline
    time.sleep(0.25)  # the deadline passes mid-generation, however fast the steps are
    finals = run_all(engine)
    assert finals["late"].error == "deadline exceeded"
    assert finals["late"].outputs[0].finish_reason == "abort"
    assert 0 < len(finals["late"].outputs[0].token_ids) < 500
    assert finals["fine"].error is None
    assert_clean(llm)


def test_waiting_queue_is_bounded(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype="float32",
        max_waiting_requests=2,
        kv_cache_memory_bytes=1 << 22,
    )
    engine = llm.engine
    engine.add_request("a", None, GREEDY, prompt_token_ids=[3])
    engine.add_request("b", None, GREEDY, prompt_token_ids=[4])
    with pytest.raises(QueueFullError, match="limit 2"):
        engine.add_request("c", None, GREEDY, prompt_token_ids=[5])
    engine.step()  # admits both: the queue has room again
    engine.add_request("c", None, GREEDY, prompt_token_ids=[5])
    assert set(run_all(engine)) == {"a", "b", "c"}
    assert_clean(llm)


def test_abort_storm_leaks_nothing(tiny_model_dir):
    """10,000 requests, about half aborted at random moments in every state."""
    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype="float32",
        num_gpu_blocks_override=32,  # small: requests get preempted too
        block_size=16,
        max_num_batched_tokens=512,
        enable_prefix_caching=True,
    )
    engine = llm.engine
    rng = random.Random(0)
    states_seen: set[RequestStatus] = set()
    live: list[str] = []
    aborted = completed = 0
    for i in range(10_000):
        prompt = [rng.randrange(3, 60) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 40), ignore_eos=True)
        engine.add_request(f"s{i}", None, params, prompt_token_ids=prompt)
        live.append(f"s{i}")
        if rng.random() < 0.3:
            for output in engine.step():
                if output.finished:
                    completed += 1
                    live.remove(output.request_id)
        preempted = [r.request_id for r in engine.scheduler.waiting if r.num_preemptions]
        if preempted and rng.random() < 0.5:
            victim = rng.choice(preempted)
            live.remove(victim)
        elif live and rng.random() < 0.5:
            victim = live.pop(rng.randrange(len(live)))
        else:
            continue
        request = engine.scheduler.requests.get(victim)
        if request is not None:
            states_seen.add(request.status)
        engine.abort_request([victim])
        aborted += 1
    completed += len(run_all(engine))
    assert aborted > 3000 and completed > 3000
    assert {RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED} <= states_seen
    assert llm.stats()["num_preemptions"] > 0
    assert_clean(llm)
