"""The input builder keeps block tables across steps: what it builds from each step's new blocks
must equal the full tables the KV manager holds, through growth, preemption, forks and trims."""

import random

import numpy as np
import pytest
import torch
from scheduler_sim import make_request, make_scheduler, run_step

from platform_core.sampling_params import SamplingParams
from platform_core.scheduler.output import ScheduledRequest, SchedulerOutput
from platform_core.worker.input_builder import InputBuilder


def _check_tables(builder, kv, output):
    """The built tables equal the manager's, zero-padded past each request's blocks."""
    host = builder.build_host(output)
    for i, item in enumerate(output.scheduled):
        expected = kv.block_ids(item.request_id)
        assert item.num_blocks == len(expected)
        row = host.block_tables[i]
        assert row[: len(expected)].tolist() == expected
        assert not row[len(expected) :].any()
        # Every token's slot lies in the request's own blocks.
        first, last = host.query_start_loc[i], host.query_start_loc[i + 1]
        assert set((host.slot_mapping[first:last] // kv.block_size).tolist()) <= set(expected)


@pytest.mark.parametrize("seed", range(6))
def test_kept_tables_match_the_managers_through_random_workloads(seed):
    rng = random.Random(seed)
    # A small pool: requests are preempted and resumed, and forks copy blocks.
    s = make_scheduler(num_blocks=24, block_size=2, max_num_seqs=5, max_num_batched_tokens=12)
    builder = InputBuilder(s.kv.block_size, torch.device("cpu"))
    steps = 0
    for request_index in range(25):
        prompt = [rng.randrange(5) for _ in range(rng.randint(1, 14))]
        n = rng.choice([1, 1, 2])
        s.add_request(make_request(f"r{request_index}", prompt, rng.randint(1, 10), n))
        if rng.random() < 0.2:
            s.abort([f"r{rng.randrange(request_index + 1)}"])
        for _ in range(rng.randint(0, 3)):
            run_step(s, lambda out: _check_tables(builder, s.kv, out))
            steps += 1
    while s.num_unfinished:
        run_step(s, lambda out: _check_tables(builder, s.kv, out))
        steps += 1
        assert steps < 2000
    assert s.stats.num_preemptions > 0, "the workload should exercise preemption"
    builder.build_host(s.schedule())  # the last step's finished ids release their tables
    assert builder.num_tables == 0


def test_blocks_given_back_by_a_trim_are_sent_again():
    s = make_scheduler(num_blocks=16, block_size=2)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=8))
    request = s.requests["a"]
    kv = s.kv
    assert kv.allocate_slots(request, 7)  # 4 blocks
    assert kv.unsent_block_ids("a") == (0, kv.block_ids("a"))
    assert kv.unsent_block_ids("a") == (4, [])
    request.num_computed_tokens = 3  # drafts rejected: keep 2 blocks
    kv.trim(request)
    assert kv.allocate_slots(request, 3)  # back to 3 blocks
    first, new = kv.unsent_block_ids("a")
    assert (first, new) == (2, kv.block_ids("a")[2:])


def _item(request_id, first_block, block_ids, start=0):
    return ScheduledRequest(
        request_id=request_id,
        token_ids=[1],
        start_position=start,
        block_ids=block_ids,
        sample=True,
        sampling_params=SamplingParams(),
        first_block=first_block,
    )


def test_a_step_adds_to_the_kept_table_and_rows_are_reused():
    builder = InputBuilder(4, torch.device("cpu"))
    host = builder.build_host(
        SchedulerOutput(scheduled=[_item("a", 0, [5, 6]), _item("b", 0, [9])])
    )
    assert host.block_tables.tolist() == [[5, 6], [9, 0]]
    host = builder.build_host(
        SchedulerOutput(scheduled=[_item("a", 2, [7], start=8), _item("b", 1, [])])
    )
    assert host.block_tables.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert host.slot_mapping.tolist() == [7 * 4, 9 * 4]
    # "a" finishes; "c" takes its row and must not see a's blocks.
    host = builder.build_host(SchedulerOutput(scheduled=[_item("c", 0, [3])], finished_ids=["a"]))
    assert host.block_tables.tolist() == [[3]]
    assert builder.num_tables == 2


def test_blocks_past_the_first_for_an_unknown_request_are_an_error():
    builder = InputBuilder(4, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="holds no block table"):
        builder.build_host(SchedulerOutput(scheduled=[_item("a", 3, [1])]))


def test_wide_tables_grow():
    builder = InputBuilder(1, torch.device("cpu"))
    blocks = list(range(100, 140))
    host = builder.build_host(SchedulerOutput(scheduled=[_item("a", 0, blocks, start=39)]))
    assert np.array_equal(host.block_tables[0], blocks)
    many = [_item(f"r{i}", 0, [i]) for i in range(20)]  # more rows than the first allocation
    host = builder.build_host(SchedulerOutput(scheduled=many))
    assert host.block_tables[:, 0].tolist() == list(range(20))
