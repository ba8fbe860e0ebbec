"""Scheduler: budget, decode-first order, chunked prefill, preemption, prefix caching."""

from scheduler_sim import fake_token, make_request, make_scheduler, run_step

from platform_core.scheduler.output import ModelRunnerOutput
from platform_core.scheduler.request import RequestStatus


def drain(scheduler, limit=1000):
    steps = []
    for _ in range(limit):
        if not scheduler.num_unfinished:
            return steps
        steps.append(run_step(scheduler))
    raise AssertionError("scheduler did not finish")


def expected_output(prompt, max_tokens):
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        out.append(fake_token(tokens))
        tokens.append(out[-1])
    return out


def test_long_prompt_is_chunked_under_the_budget():
    s = make_scheduler(max_num_batched_tokens=16)
    s.add_request(make_request("a", list(range(40)), max_tokens=2))
    chunks = [out.scheduled[0].num_tokens for out, _ in drain(s)]
    assert chunks[:3] == [16, 16, 8]  # 40-token prompt in three chunks, then one decode
    assert chunks[3:] == [1]


def test_chunked_prefill_off_waits_for_budget():
    s = make_scheduler(max_num_batched_tokens=16, chunked_prefill=False)
    s.add_request(make_request("a", list(range(40))))
    out, _ = run_step(s)
    assert out.is_empty


def test_decodes_are_scheduled_before_new_prefills():
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(make_request("a", list(range(5)), max_tokens=5))
    run_step(s)  # a's prefill
    s.add_request(make_request("b", list(range(50, 80)), max_tokens=5))
    out, _ = run_step(s)
    ids = [(r.request_id, r.num_tokens) for r in out.scheduled]
    assert ids[0] == ("a", 1)
    assert ids[1] == ("b", 9)  # the rest of the budget


def test_max_num_seqs_caps_the_batch():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        s.add_request(make_request(f"r{i}", [i, i + 1]))
    for out, _ in drain(s):
        assert len(out.scheduled) <= 2


def test_preemption_picks_most_recent_and_output_is_unchanged():
    prompts = {f"r{i}": [i * 10 + j for j in range(7)] for i in range(4)}
    s = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64, prefix_caching=False)
    for rid, prompt in prompts.items():
        s.add_request(make_request(rid, prompt, max_tokens=8))
    requests = dict(s.requests)
    steps = drain(s)
    preempted = [rid for out, _ in steps for rid in out.preempted_ids]
    assert preempted, "the pool is too small for all four: something must be preempted"
    # The first victim is the most recently admitted running request.
    first_step = next(out for out, _ in steps if out.preempted_ids)
    assert first_step.preempted_ids[0] == "r3"
    for rid, prompt in prompts.items():
        assert requests[rid].output_token_ids == expected_output(prompt, 8)
        assert requests[rid].status == RequestStatus.FINISHED_LENGTH
    s.check_kv_integrity()
    assert s.kv_stats().num_free_blocks == 9


def test_waiting_requests_never_preempt():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add_request(make_request("a", list(range(10)), max_tokens=4))
    run_step(s)
    s.add_request(make_request("b", list(range(20, 30))))
    out, _ = run_step(s)
    assert out.preempted_ids == []
    assert [r.request_id for r in out.scheduled] == ["a"]


def test_prefix_cache_hits_skip_computed_tokens():
    s = make_scheduler(block_size=4, max_num_batched_tokens=64)
    shared = list(range(16))
    s.add_request(make_request("a", shared + [100], max_tokens=1))
    drain(s)
    s.add_request(make_request("b", shared + [200, 201], max_tokens=1))
    out, _ = run_step(s)
    item = out.scheduled[0]
    assert item.start_position == 16 and item.num_tokens == 2
    assert s.kv_stats().prefix_hit_tokens == 16


def test_request_waits_a_step_for_a_prefix_being_computed():
    s = make_scheduler(block_size=4, max_num_batched_tokens=64)
    shared = list(range(16))
    s.add_request(make_request("a", shared + [100], max_tokens=2))
    request_b = make_request("b", shared + [200, 201], max_tokens=2)
    s.add_request(request_b)
    # Plenty of budget, but b's prompt is mostly blocks a computes in this step.
    out, _ = run_step(s)
    assert [r.request_id for r in out.scheduled] == ["a"]
    out, _ = run_step(s)
    b = next(r for r in out.scheduled if r.request_id == "b")
    assert b.start_position == 16 and b.num_tokens == 2  # found cached instead of recomputed
    assert s.kv_stats().prefix_hit_tokens == 16
    drain(s)
    assert request_b.output_token_ids == expected_output(shared + [200, 201], 2)


def test_small_shared_part_or_no_caching_does_not_delay():
    prompt_a, prompt_b = list(range(9)), list(range(4)) + list(range(50, 62))
    for caching in (True, False):
        s = make_scheduler(block_size=4, max_num_batched_tokens=64, prefix_caching=caching)
        s.add_request(make_request("a", prompt_a))
        s.add_request(make_request("b", prompt_b))  # one shared block out of four
        out, _ = run_step(s)
        assert [r.request_id for r in out.scheduled] == ["a", "b"]


def test_abort_frees_blocks_in_any_state():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    s.add_request(make_request("running", list(range(20)), max_tokens=50))
    s.add_request(make_request("waiting", list(range(30, 40))))
    run_step(s)
    assert s.requests["running"].status == RequestStatus.RUNNING
    aborted = s.abort(["running", "waiting", "unknown"])
    assert {r.request_id for r in aborted} == {"running", "waiting"}
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    s.check_kv_integrity()
    assert s.kv_stats().num_free_blocks == 16
    assert s.num_unfinished == 0


def test_duplicate_request_id_is_refused():
    s = make_scheduler()
    s.add_request(make_request("a", [1]))
    try:
        s.add_request(make_request("a", [2]))
    except ValueError as exc:
        assert "already in use" in str(exc)
    else:
        raise AssertionError("duplicate id accepted")


def test_a_fork_without_a_block_for_its_copy_waits_and_ends_the_same():
    prompt = list(range(6))  # one full 4-token block and a partial one
    finals = {}
    for num_blocks in (16, 3):  # room for every copy; room for one copy only
        s = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64)
        s.add_request(make_request("a", prompt, max_tokens=3, n=3))
        out, _ = run_step(s)
        assert out.scheduled[0].fork_ids == ["a#1", "a#2"]
        children = [s.requests["a#1"], s.requests["a#2"]]
        if num_blocks == 3:
            assert [c.status for c in children] == [RequestStatus.RUNNING, RequestStatus.PREEMPTED]
            assert children[1].num_computed_tokens == 0
        else:
            assert all(c.status == RequestStatus.RUNNING for c in children)
        requests = [s.requests["a"], *children]
        drain(s)
        s.check_kv_integrity()
        assert s.kv_stats().num_free_blocks == num_blocks
        finals[num_blocks] = [r.output_token_ids for r in requests]
    first = fake_token(prompt)
    assert [tokens[0] for tokens in finals[16]] == [first, first + 1, first + 2]
    assert finals[3] == finals[16]


def test_drafts_ride_one_step_and_the_rejected_ones_are_rolled_back():
    s = make_scheduler(block_size=4, max_num_batched_tokens=64)
    request = make_request("a", list(range(8)), max_tokens=8)
    s.add_request(request)
    run_step(s)  # the prompt, then one sampled token: 9 known, 8 computed
    request.spec_token_ids = [50, 51, 52, 53]
    out = s.schedule()
    [item] = out.scheduled
    assert item.num_tokens == 5 and item.draft_token_ids == [50, 51, 52, 53]
    assert request.spec_token_ids == []  # drafts go out with one step only
    assert len(s.kv.block_ids("a")) == 4  # room for 13 tokens
    # The target accepts the first draft, rejects the second and samples 77 instead.
    s.update(out, ModelRunnerOutput(sampled={"a": [50, 77]}))
    assert request.output_token_ids[1:] == [50, 77]
    assert request.num_computed_tokens == 10  # the three rejected drafts' K/V do not count
    assert len(s.kv.block_ids("a")) == 3  # the block only the rejected drafts used is freed
    stats = s.stats
    assert (stats.spec_verifications, stats.spec_proposed_tokens) == (1, 4)
    assert stats.spec_accepted_tokens == 1 and stats.spec_mean_accepted_length == 2.0
    s.check_kv_integrity()


def test_drafts_are_cut_to_the_budget_and_dropped_for_a_prefill():
    s = make_scheduler(block_size=4, max_num_batched_tokens=3)
    request = make_request("a", list(range(5)), max_tokens=8)
    s.add_request(request)
    run_step(s)  # a 3-token chunk of the prompt
    request.spec_token_ids = [7, 7]
    out, _ = run_step(s)  # the rest of the prompt: drafts never follow a prefill chunk
    assert out.scheduled[0].num_tokens == 2 and out.scheduled[0].num_draft_tokens == 0
    request.spec_token_ids = [50, 51, 52, 53]
    [item] = s.schedule().scheduled
    assert item.num_draft_tokens == 2 and item.num_tokens == 3  # one token and two drafts
