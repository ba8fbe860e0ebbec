"""The scheduler with a KV connector, against a scripted connector (no model, no transport):
loading requests wait without running, land with their loaded blocks, fall back to recompute,
free their blocks when aborted only once the load ends; held blocks wait for the peer or the
timeout. Block-pool integrity is checked after every scenario."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_sim import make_request

from platform_core.config import CacheConfig, SchedulerConfig
from platform_core.kv_transfer.interfaces import (
    FinishedRequestKV,
    KVConnectorOutput,
    KVConnectorScheduler,
    RemoteTokens,
)
from platform_core.scheduler.output import ModelRunnerOutput
from platform_core.scheduler.request import RequestStatus
from platform_core.scheduler.scheduler import Scheduler

BLOCK = 4


class ScriptedConnector(KVConnectorScheduler):
    """Says a remote instance holds ``remote[request_id]`` tokens; records every call."""

    def __init__(self, remote: dict[str, int] | None = None, hold: bool = False):
        self.remote = remote or {}
        self.hold = hold
        self.asked: list[tuple[str, int]] = []
        self.allocated: dict[str, tuple[list[int], int]] = {}
        self.released: list[tuple[str, str]] = []
        self.finished: list[str] = []
        self.steps = 0

    def remote_tokens(self, request, num_local_tokens):
        self.asked.append((request.request_id, num_local_tokens))
        return RemoteTokens(max(0, self.remote.get(request.request_id, 0) - num_local_tokens))

    def blocks_allocated(self, request, block_ids, first_block):
        self.allocated[request.request_id] = (list(block_ids), first_block)

    def request_finished(self, request, block_ids, num_computed_tokens):
        self.finished.append(request.request_id)
        return FinishedRequestKV(hold=self.hold, params={"blocks": len(block_ids)})

    def release(self, request_id, reason):
        self.released.append((request_id, reason))

    def build_metadata(self):
        self.steps += 1
        return {"step": self.steps}


def scheduler_with(connector, num_blocks=32, budget=64, timeout_s=60.0) -> Scheduler:
    return Scheduler(
        SchedulerConfig(8, budget, True),
        CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        num_blocks,
        kv_connector=connector,
        kv_hold_timeout_s=timeout_s,
    )


def step(s: Scheduler, report: KVConnectorOutput | None = None):
    """One step where every scheduled request samples token 7; ``report`` from the worker."""
    out = s.schedule()
    sampled = {r.request_id: [7] for r in out.scheduled if r.sample}
    finished = s.update(out, ModelRunnerOutput(sampled=sampled, kv_connector=report))
    s.check_kv_integrity()
    return out, finished


def used_blocks(s: Scheduler) -> int:
    return s.kv_stats().num_used_blocks


def test_a_loading_request_waits_without_running_or_holding_up_others():
    connector = ScriptedConnector({"remote": 13})
    s = scheduler_with(connector)
    s.add_request(make_request("remote", list(range(13)), max_tokens=2))
    s.add_request(make_request("local", list(range(50, 55)), max_tokens=2))
    out, _ = step(s)
    assert [r.request_id for r in out.scheduled] == ["local"]  # admitted past the loading one
    assert out.kv_connector_metadata == {"step": 1}
    assert s.num_running == 1 and s.num_unfinished == 2
    blocks, first = connector.allocated["remote"]
    # 13 tokens: blocks 0-2 (12 tokens) load; the last token is computed here for its logits.
    assert (len(blocks), first) == (3, 0)
    assert s.requests["remote"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, KVConnectorOutput(finished_recving={"remote"}))  # lands after this step's schedule
    out, _ = step(s)
    scheduled = {r.request_id: r for r in out.scheduled}
    assert scheduled["remote"].start_position == 12 and scheduled["remote"].num_tokens == 1
    assert s.remote_kv.stats.num_loaded_tokens == 12


def test_loaded_blocks_join_the_prefix_cache():
    s = scheduler_with(ScriptedConnector({"remote": 12}))
    prompt = list(range(12))
    s.add_request(make_request("remote", prompt, max_tokens=1))
    step(s)
    step(s, KVConnectorOutput(finished_recving={"remote"}))
    while s.num_unfinished:
        step(s)
    s.add_request(make_request("again", prompt, max_tokens=1))
    out, _ = step(s)
    again = next(r for r in out.scheduled if r.request_id == "again")
    assert again.start_position == 8  # two loaded blocks found (the third holds the last token)


def test_consumer_asks_only_for_what_its_prefix_cache_lacks():
    connector = ScriptedConnector({"second": 17})
    s = scheduler_with(connector)
    prompt = list(range(17))
    s.add_request(make_request("first", prompt[:9], max_tokens=1))
    while s.num_unfinished:
        step(s)
    s.add_request(make_request("second", prompt, max_tokens=1))
    step(s)
    assert ("second", 8) in connector.asked  # two blocks cached here
    blocks, first = connector.allocated["second"]
    assert (len(blocks), first) == (2, 2)  # blocks 2-3; block 4 holds the last token


def test_a_failed_block_is_recomputed_with_everything_after_it():
    connector = ScriptedConnector({"r": 17})
    s = scheduler_with(connector)
    s.add_request(make_request("r", list(range(17)), max_tokens=1))
    step(s)
    blocks, _ = connector.allocated["r"]
    before = used_blocks(s)
    step(s, KVConnectorOutput(finished_recving={"r"}, failed_blocks={"r": [blocks[2]]}))
    out, _ = step(s)
    [item] = out.scheduled
    assert item.start_position == 8  # blocks 0-1 loaded; 2 failed: recompute from token 8
    assert s.remote_kv.stats.num_recomputed_tokens == 8
    assert used_blocks(s) <= before


def test_an_abort_while_loading_frees_blocks_only_once_the_load_ends():
    connector = ScriptedConnector({"r": 17})
    s = scheduler_with(connector)
    s.add_request(make_request("r", list(range(17)), max_tokens=1))
    step(s)
    held = used_blocks(s)
    assert held == 4  # the four loadable blocks (the 17th token is computed later)
    s.abort(["r"])
    assert connector.released == [("r", "aborted")]
    assert used_blocks(s) == held and s.has_pending_transfers
    with pytest.raises(ValueError, match="in use"):
        s.add_request(make_request("r", [1, 2, 3]))  # its blocks are still kept under its id
    step(s, KVConnectorOutput(finished_recving={"r"}))
    assert used_blocks(s) == 0 and not s.has_pending_transfers


def test_a_held_request_keeps_its_blocks_until_the_peer_has_them():
    connector = ScriptedConnector(hold=True)
    s = scheduler_with(connector)
    s.add_request(make_request("p", list(range(10)), max_tokens=1))
    _, finished = step(s)
    assert [r.request_id for r in finished] == ["p"]
    assert finished[0].kv_transfer_result == {"blocks": 3}
    assert used_blocks(s) == 3 and s.has_pending_transfers
    assert s.num_unfinished == 0  # held blocks are not a request
    step(s, KVConnectorOutput(finished_sending={"p"}))
    assert used_blocks(s) == 0 and not s.has_pending_transfers


def test_a_hold_times_out():
    connector = ScriptedConnector(hold=True)
    s = scheduler_with(connector, timeout_s=0.05)
    s.add_request(make_request("p", list(range(10)), max_tokens=1))
    step(s)
    time.sleep(0.06)
    step(s)
    assert connector.released == [("p", "timeout")]
    assert used_blocks(s) == 0
    assert s.remote_kv.stats.num_hold_timeouts == 1


def test_aborted_and_failed_requests_are_not_held():
    connector = ScriptedConnector(hold=True)
    s = scheduler_with(connector)
    s.add_request(make_request("p", list(range(10)), max_tokens=5))
    step(s)
    s.abort(["p"])
    assert connector.finished == [] and used_blocks(s) == 0


def test_no_room_for_the_remote_blocks_keeps_the_request_waiting():
    connector = ScriptedConnector({"big": 24})
    s = scheduler_with(connector, num_blocks=8)
    s.add_request(make_request("hog", list(range(16)), max_tokens=20))
    step(s)  # holds 4 of 8 blocks, then 5 once it decodes past them
    s.add_request(make_request("big", list(range(100, 125)), max_tokens=1))  # 6 blocks to load
    step(s)
    assert "big" not in connector.allocated
    assert s.requests["big"].status is RequestStatus.WAITING
    s.abort(["hog"])
    step(s)
    assert "big" in connector.allocated  # asked again once there was room


def test_prompt_logprobs_compute_the_prompt_and_release_the_offer():
    connector = ScriptedConnector({"r": 12})
    s = scheduler_with(connector)
    request = make_request("r", list(range(12)), max_tokens=1)
    request.sampling_params.prompt_logprobs = 1
    s.add_request(request)
    out, _ = step(s)
    assert out.scheduled[0].start_position == 0 and "r" not in connector.allocated
    assert connector.released == [("r", "unused")]


# ---------------------------------------------------------------------------- property test
class RandomWorker:
    """Plays the worker side: loads end after a random number of steps, some with a failed
    block; held blocks are confirmed (or not) at random."""

    def __init__(self, draw_int):
        self.draw = draw_int
        self.loads: dict[str, tuple[int, list[int]]] = {}  # request id -> (steps left, blocks)

    def report(self, connector: ScriptedConnector, s: Scheduler) -> KVConnectorOutput:
        output = KVConnectorOutput()
        for request_id, (blocks, _) in connector.allocated.items():
            if request_id not in self.loads:
                self.loads[request_id] = (self.draw(0, 3), blocks)
        connector.allocated.clear()
        for request_id, (left, blocks) in list(self.loads.items()):
            if left > 0:
                self.loads[request_id] = (left - 1, blocks)
                continue
            del self.loads[request_id]
            output.finished_recving.add(request_id)
            if blocks and self.draw(0, 2) == 0:
                output.failed_blocks[request_id] = [blocks[self.draw(0, len(blocks) - 1)]]
        for request_id in list(s.remote_kv.held):
            if self.draw(0, 2) == 0:
                output.finished_sending.add(request_id)
        return output


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), num_blocks=st.integers(16, 40), hold=st.booleans())
def test_random_loads_aborts_and_holds_leak_nothing(data, num_blocks, hold):
    draw_int = lambda lo, hi: data.draw(st.integers(lo, hi))  # noqa: E731 - a tiny adapter
    connector = ScriptedConnector(hold=hold)
    s = scheduler_with(connector, num_blocks=num_blocks, budget=24, timeout_s=60.0)
    worker = RandomWorker(draw_int)
    next_id = 0
    for _ in range(data.draw(st.integers(1, 40))):
        action = data.draw(st.sampled_from(["add", "abort", "step"]))
        if action == "add":
            length = draw_int(1, 4 * BLOCK * 2)
            request_id = f"r{next_id}"
            next_id += 1
            connector.remote[request_id] = draw_int(0, length)
            s.add_request(make_request(request_id, [draw_int(0, 3) for _ in range(length)], 3))
        elif action == "abort":
            s.abort([f"r{draw_int(0, max(next_id, 1))}"])
        else:
            step(s, worker.report(connector, s))
    for _ in range(500):  # drain: loads end, holds are confirmed
        if not (s.num_unfinished or s.has_pending_transfers):
            break
        report = worker.report(connector, s)
        report.finished_sending |= set(s.remote_kv.held)
        step(s, report)
    assert s.num_unfinished == 0 and not s.has_pending_transfers
    assert s.kv_stats().num_free_blocks == num_blocks
