"""Step deltas (issue #26): what ``DeltaWriter`` writes in the engine core and
``OutputAssembler`` rebuilds in the front equals the engine's own outputs, at every step, for
the usual request (in the columns) and every unusual one (in full)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from server_utils import engine_config

from platform_core.engine.core_messages import ENCODER, EVENT_DECODER, CoreBatch
from platform_core.engine.faults import FaultInjector
from platform_core.engine.llm_engine import LLMEngine
from platform_core.engine.output_assembly import OutputAssembler
from platform_core.engine.output_deltas import DeltaWriter
from platform_core.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from platform_core.engine.request_stream import GenerateRequest
from platform_core.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm_engine(text_model_dir):
    return LLMEngine(engine_config(text_model_dir))


def _send(writer: DeltaWriter, assembler: OutputAssembler, outputs: list[RequestOutput]):
    """``outputs`` (one step's) through writer, wire and assembler: the step and the rebuilt
    outputs by request id."""
    batch = CoreBatch([], [], writer.write(outputs), None)
    step = EVENT_DECODER.decode(ENCODER.encode(batch)).outputs
    rebuilt = assembler.apply(step)
    by_id = {output.request_id: output for output in rebuilt}
    assert len(by_id) == len(rebuilt), "a request came back twice"
    return step, by_id


def _run_through_deltas(engine: LLMEngine, requests: list[GenerateRequest], at_step=None):
    """Step ``engine`` over ``requests``; each step's outputs go through writer, wire and
    assembler and must come out equal to the engine's own (metrics included), at that very
    step. ``at_step`` maps a step number to a callback run after it with the writer and the
    assembler. Returns the final outputs, which requests ever went in the columns and how often
    each request's prompt ids were sent."""
    writer, assembler = DeltaWriter(), OutputAssembler()
    for r in requests:
        engine.add_request(r.request_id, r.prompt, r.params, r.prompt_token_ids)
        writer.expect(r)
        assembler.expect(r)
    finals, in_columns, prompt_ids_sent, steps = {}, set(), Counter(), 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        step, rebuilt = _send(writer, assembler, outputs)
        in_columns.update(step.request_ids)
        prompt_ids_sent.update(d.request_id for d in step.others if d.prompt_token_ids)
        assert set(rebuilt) == {o.request_id for o in outputs}
        for output in outputs:
            assert rebuilt[output.request_id] == output, (rebuilt[output.request_id], output)
            assert rebuilt[output.request_id].outputs is not output.outputs
            if output.finished:
                finals[output.request_id] = rebuilt[output.request_id]
        if at_step and steps in at_step:
            at_step[steps](writer, assembler)
    assert len(writer) == len(assembler) == 0, "finished or aborted requests were kept"
    return finals, in_columns, prompt_ids_sent


def test_deltas_rebuild_the_engines_outputs_exactly(llm_engine):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    (plain,) = _run_through_deltas(
        llm_engine, [GenerateRequest("probe", "The capital of", sampled)]
    )[0].values()
    text = plain.outputs[0].text
    assert len(text) >= 6, text
    stop = text[3:5]  # the seeded sample reaches it again, and stops there
    requests = [
        GenerateRequest("text-prompt", "The capital of", greedy),  # prompt ids come back once
        GenerateRequest("ids", None, greedy, [5, 40, 17, 99]),
        GenerateRequest(
            "logprobs",
            "A paged",
            SamplingParams(max_tokens=9, logprobs=3, prompt_logprobs=2, seed=1),
        ),
        GenerateRequest(
            "n3",
            "Rome",
            SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, logprobs=1, ignore_eos=True),
        ),
        GenerateRequest("stop", "The capital of", dataclasses.replace(sampled, stop=[stop])),
        GenerateRequest(
            "stop-kept",
            "The capital of",
            dataclasses.replace(sampled, stop=[stop], include_stop_str_in_output=True),
        ),
        GenerateRequest("aborted", None, SamplingParams(max_tokens=50, ignore_eos=True), [9, 8, 7]),
        GenerateRequest("failing", None, SamplingParams(max_tokens=50, ignore_eos=True), [9, 7]),
    ]

    def abort(writer, assembler):
        llm_engine.abort_request(["aborted"])
        writer.forget(["aborted"])
        assembler.forget(["aborted"])

    def fail(writer, assembler):
        llm_engine.faults = FaultInjector({"failing": "postprocess"})

    try:
        finals, in_columns, prompt_ids_sent = _run_through_deltas(
            llm_engine, requests, at_step={3: abort, 4: fail}
        )
    finally:
        llm_engine.faults = None
    assert finals["text-prompt"].prompt_token_ids == plain.prompt_token_ids
    assert finals["logprobs"].prompt_logprobs and finals["logprobs"].outputs[0].logprobs
    assert len(finals["n3"].outputs) == 3
    assert finals["stop"].outputs[0].finish_reason == "stop"
    assert finals["stop"].outputs[0].text == text[:3]
    assert finals["stop-kept"].outputs[0].text == text[:5]
    assert finals["failing"].error and "injected fault" in finals["failing"].error
    assert len(finals["failing"].outputs[0].token_ids) >= 3
    assert "aborted" not in finals
    # The usual requests went in the columns after their first step; n > 1 never does.
    assert {"text-prompt", "ids", "logprobs", "stop", "aborted", "failing"} <= in_columns
    assert "n3" not in in_columns
    text_prompts = [r.request_id for r in requests if r.prompt_token_ids is None]
    assert prompt_ids_sent == dict.fromkeys(text_prompts, 1)


def _pair(*requests: GenerateRequest) -> tuple[DeltaWriter, OutputAssembler]:
    writer, assembler = DeltaWriter(), OutputAssembler()
    for request in requests:
        writer.expect(request)
        assembler.expect(request)
    return writer, assembler


def _output(request_id, text, tokens, **fields) -> RequestOutput:
    metrics = fields.pop("metrics", RequestMetrics(1.0, 2.0, 3.0))
    completion = CompletionOutput(0, text, tokens, **fields.pop("completion", {}))
    finished = fields.pop("finished", False)
    return RequestOutput(request_id, None, [1], [completion], finished, metrics, **fields)


def test_a_text_that_changes_other_than_by_growing_is_sent_whole():
    writer, assembler = _pair(GenerateRequest("r", None, SamplingParams(), [1]))
    for text in ("abc", "abcdef", "abXY"):
        output = _output("r", text, [1, 2])
        step, rebuilt = _send(writer, assembler, [output])
        assert rebuilt == {"r": output}
    assert not step.request_ids and step.others[0].completions[0].text_start == 0


def test_what_is_not_a_plain_append_leaves_the_columns_and_still_rebuilds_exactly():
    """Changed metrics or cached tokens, a finish: each request in full, for that step only."""
    requests = [GenerateRequest(f"r{i}", None, SamplingParams(), [1]) for i in range(5)]
    writer, assembler = _pair(*requests)
    _send(writer, assembler, [_output(f"r{i}", "a", [5]) for i in range(5)])
    preempted = RequestMetrics(1.0, 2.0, 3.0, None, 0, 1)
    steps = [
        [  # r1's metrics changed, r2 got cached tokens, r3 finished
            _output("r0", "ab", [5, 6]),
            _output("r1", "ab", [5, 6], metrics=preempted),
            _output("r2", "ab", [5, 6], num_cached_tokens=16),
            _output("r3", "ab", [5, 6], finished=True, completion={"finish_reason": "length"}),
            # its sample stopped, the request not yet (its other samples are still to come)
            _output("r4", "ab", [5, 6], completion={"finish_reason": "stop", "stop_reason": "b"}),
        ],
        [
            _output("r0", "abc", [5, 6, 7]),
            _output("r1", "abc", [5, 6, 7], metrics=preempted),
            _output("r2", "abc", [5, 6, 7], num_cached_tokens=16),
        ],
    ]
    in_columns = []
    for outputs in steps:
        step, rebuilt = _send(writer, assembler, outputs)
        assert rebuilt == {o.request_id: o for o in outputs}
        in_columns.append(step.request_ids)
    assert in_columns == [["r0"], ["r0", "r1", "r2"]]
    assert len(writer) == len(assembler) == 4


def test_a_request_the_front_forgot_is_skipped_without_shifting_the_others():
    requests = [GenerateRequest(f"r{i}", None, SamplingParams(logprobs=1), [1]) for i in range(3)]
    writer, assembler = _pair(*requests)

    def step_outputs(length: int) -> list[RequestOutput]:
        positions = [{t: Logprob(-0.5 * t)} for t in range(1, length + 1)]
        return [
            _output(
                f"r{i}",
                "x" * length * (i + 1),
                list(range(i, i + length)),
                completion={"logprobs": positions, "cumulative_logprob": -1.0 * length},
            )
            for i in range(3)
        ]

    _send(writer, assembler, step_outputs(1))
    assembler.forget(["r0"])  # aborted on the front, its outputs still on the way
    step, rebuilt = _send(writer, assembler, step_outputs(3))
    assert step.request_ids == ["r0", "r1", "r2"] and step.token_counts == [2, 2, 2]
    assert rebuilt == {o.request_id: o for o in step_outputs(3)[1:]}
    assert rebuilt["r2"].outputs[0].token_ids == [2, 3, 4]


def test_a_request_the_writer_was_not_told_of_is_sent_in_full_then_in_the_columns():
    request = GenerateRequest("r", None, SamplingParams(), [1])
    writer, assembler = DeltaWriter(), OutputAssembler()
    assembler.expect(request)
    in_columns = []
    for length in (1, 2):
        output = _output("r", "a" * length, [5] * length)
        step, rebuilt = _send(writer, assembler, [output])
        assert rebuilt == {"r": output}
        in_columns.append(step.request_ids)
    assert in_columns == [[], ["r"]] and len(writer) == 1
