"""Scheduler with LoRA: at most ``max_loras`` adapters run at once, without holding others up."""

from scheduler_sim import make_request, make_scheduler, run_step

from platform_core.lora_request import LoRARequest

ADAPTERS = {name: LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("ABC", 1)}


def adapter_request(request_id, adapter, prompt_start=0, max_tokens=4):
    request = make_request(request_id, list(range(prompt_start, prompt_start + 6)), max_tokens)
    request.lora_request = None if adapter is None else ADAPTERS[adapter]
    return request


def running_adapters(scheduler):
    return {r.lora_request.lora_name for r in scheduler.running if r.lora_request}


def drain(scheduler, limit=200):
    steps = []
    for _ in range(limit):
        if not scheduler.num_unfinished:
            return steps
        steps.append(run_step(scheduler)[0])
        assert len(running_adapters(scheduler)) <= scheduler.max_loras
    raise AssertionError("scheduler did not finish")


def test_a_third_adapter_waits_while_later_requests_of_running_ones_and_the_base_run():
    s = make_scheduler(max_num_seqs=8, max_loras=2)
    order = [("a1", "A"), ("b1", "B"), ("c1", "C"), ("a2", "A"), ("base", None), ("c2", "C")]
    for i, (request_id, adapter) in enumerate(order):
        s.add_request(adapter_request(request_id, adapter, prompt_start=10 * i))
    first = run_step(s)[0]
    assert [r.request_id for r in first.scheduled] == ["a1", "b1", "a2", "base"]
    assert [r.lora_request for r in first.scheduled][:2] == [ADAPTERS["A"], ADAPTERS["B"]]
    # The passed-over requests keep their place at the head of the queue, in order.
    assert [r.request_id for r in s.waiting] == ["c1", "c2"]
    steps = [first, *drain(s)]
    started = {}
    for index, step in enumerate(steps):
        for item in step.scheduled:
            started.setdefault(item.request_id, index)
    assert started["c1"] == started["c2"] > started["a2"]
    s.check_kv_integrity()
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks


def test_without_a_limit_every_adapter_runs_at_once():
    s = make_scheduler(max_num_seqs=8)
    for i, adapter in enumerate("ABCABC"):
        s.add_request(adapter_request(f"r{i}", adapter, prompt_start=10 * i))
    assert len(run_step(s)[0].scheduled) == 6


def test_forks_and_preempted_requests_keep_their_adapter():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=8, max_loras=1)
    parent = make_request("p", list(range(6)), max_tokens=6, n=2)
    parent.lora_request = ADAPTERS["A"]
    s.add_request(parent)
    s.add_request(adapter_request("other", "A", prompt_start=50, max_tokens=6))
    seen = set()
    while s.num_unfinished:
        out, _ = run_step(s)
        for item in out.scheduled:
            assert item.lora_request == ADAPTERS["A"], item.request_id
            seen.add(item.request_id)
    assert {"p", "p#1", "other"} <= seen
    assert s.stats.num_preemptions > 0


def test_at_most_max_num_seqs_requests_are_passed_over_in_a_step():
    s = make_scheduler(max_num_seqs=4, max_loras=1)
    s.add_request(adapter_request("a", "A", max_tokens=8))
    run_step(s)  # A runs
    blocked = [f"c{i}" for i in range(5)]
    for i, request_id in enumerate(blocked):
        s.add_request(adapter_request(request_id, "C", prompt_start=10 * (i + 1)))
    s.add_request(adapter_request("base", None, prompt_start=90))
    out, _ = run_step(s)
    # Four Cs passed over reach the bound (max_num_seqs): the pass stops, the base request waits.
    assert [r.request_id for r in out.scheduled] == ["a"]
    assert [r.request_id for r in s.waiting] == [*blocked, "base"]
