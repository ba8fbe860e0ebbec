"""Structured outputs through ``LLM.generate``: every output matches its constraint, together with
continuous batching, chunked prefill, prefix caching, preemption, n > 1 and speculation.

The tiny random model writes unbounded text wherever a constraint lets it, so every constraint
here bounds its output (``json_object`` is tested on the default model, in the server tests).
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from platform_core import LLM, SamplingParams
from platform_core.errors import InvalidRequestError
from platform_core.reasoning import ReasoningParser, register_reasoning_parser
from platform_core.structured_outputs_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        # not maxLength: xgrammar 0.2's length-bounded strings admit control characters
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 2},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
    "$defs": {"tag": {"type": "string", "enum": ["x", "y", "z"]}},
}
DIGITS = r"[0-9]{24}"  # long and repetitive: the n-gram proposer drafts on it
CHOICES = ["Paris", "Rome", "Köln", 'say "hi"']
GRAMMAR = 'root ::= "x" [0-9] [0-9]? " " ("ok" | "no")'


def check_json(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


CONSTRAINTS = [
    (StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), check_json),
    (StructuredOutputsParams(regex=DIGITS), lambda t: re.fullmatch(DIGITS, t) or pytest.fail(t)),
    (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES or pytest.fail(t)),
    (
        StructuredOutputsParams(grammar=GRAMMAR),
        lambda t: re.fullmatch("x[0-9]{1,2} (ok|no)", t) or pytest.fail(t),
    ),
]
PROMPTS = [
    "The capital of France is Paris. The capital of Italy is",
    "A quick brown fox jumps over the lazy dog, again and again. " * 4,  # chunked when small
    "Grüße aus Köln!",
]


def constrained_params(temperature: float, n: int = 1) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=temperature, seed=7, n=n, max_tokens=80, structured_outputs=constraint
        )
        for constraint, _ in CONSTRAINTS
    ]


def run_all(llm: LLM, temperature: float, n: int = 1) -> list[list[str]]:
    """Every prompt under every constraint in one batch; each output checked."""
    prompts, params, checks = [], [], []
    for p, (_, check) in zip(constrained_params(temperature, n), CONSTRAINTS):
        for prompt in PROMPTS:
            prompts.append(prompt)
            params.append(p)
            checks.append(check)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    texts = []
    for output, check in zip(outputs, checks):
        assert len(output.outputs) == n
        for sample in output.outputs:
            assert sample.finish_reason == "stop", sample.text
            check(sample.text)
        texts.append([s.text for s in output.outputs])
    llm.check_kv_integrity()
    assert llm.stats()["kv_blocks_used"] == 0
    return texts


@pytest.fixture(scope="module")
def plain(text_model_dir) -> LLM:
    return LLM(str(text_model_dir), dtype="float32")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_output_matches_its_constraint(plain, temperature):
    run_all(plain, temperature, n=2)


def test_greedy_outputs_are_the_same_under_speculation_preemption_and_chunking(
    text_model_dir, plain
):
    expected = run_all(plain, 0.0)
    stressed = LLM(
        str(text_model_dir),
        dtype="float32",
        speculative_method="ngram",
        num_speculative_tokens=4,
        max_num_batched_tokens=32,  # the long prompt is prefilled in chunks
        num_gpu_blocks_override=24,  # too few for the batch: requests are preempted
        block_size=16,
    )
    assert run_all(stressed, 0.0) == expected
    assert run_all(stressed, 0.0) == expected  # again, on cached prefixes
    stats = stressed.stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec_accepted_tokens"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    run_all(stressed, 0.8, n=2)


def test_sampled_outputs_are_valid_under_speculation(text_model_dir):
    llm = LLM(str(text_model_dir), dtype="float32", speculative_method="ngram")
    run_all(llm, 0.8, n=2)


def test_the_llguidance_engine_gives_valid_outputs(text_model_dir):
    llm = LLM(str(text_model_dir), dtype="float32", structured_outputs_backend="guidance")
    for p, (_, check) in zip(constrained_params(0.8), CONSTRAINTS):
        for output in llm.generate(PROMPTS, p, use_tqdm=False):
            check(output.outputs[0].text)


def test_auto_falls_back_to_llguidance_for_a_lark_grammar(text_model_dir, plain):
    lark = StructuredOutputsParams(grammar='start: "yes" | "no"')
    with pytest.raises(InvalidRequestError, match="xgrammar") as refused:
        LLM(str(text_model_dir), dtype="float32", structured_outputs_backend="xgrammar").generate(
            PROMPTS[0], SamplingParams(structured_outputs=lark), use_tqdm=False
        )
    assert refused.value.param == "structured_outputs"
    output = plain.generate(PROMPTS[0], SamplingParams(structured_outputs=lark), use_tqdm=False)
    assert output[0].outputs[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "constraint, problem",
    [
        ({"json": {"type": "nonsense"}}, "nonsense"),
        ({"regex": "(ab"}, "parenthesis"),
        ({"grammar": "root ::= missing"}, "missing"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"choice": []}, "non-empty list"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"jsn": {}}, "unknown"),
        ({"json_object": "yes"}, "boolean"),
    ],
)
def test_a_bad_constraint_is_refused_with_its_reason(plain, constraint, problem):
    with pytest.raises(InvalidRequestError, match=problem) as refused:
        plain.generate(PROMPTS[0], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert refused.value.param == "structured_outputs"
    plain.check_kv_integrity()
    assert not plain.llm_engine.has_unfinished_requests()


def test_grammars_are_compiled_once_per_constraint(text_model_dir):
    llm = LLM(str(text_model_dir), dtype="float32")
    timing = llm.llm_engine.structured.timing
    params = SamplingParams(max_tokens=30, structured_outputs={"json": PERSON})
    llm.generate(PROMPTS, params, use_tqdm=False)
    llm.generate(PROMPTS, params, use_tqdm=False)
    assert timing.compiles == 1
    assert timing.hits == 5  # every request after the first found it compiled


def test_a_request_waiting_for_its_grammar_holds_up_no_one(text_model_dir, monkeypatch):
    llm = LLM(str(text_model_dir), dtype="float32")
    engine = llm.llm_engine
    release = threading.Event()
    compile_for_real = engine.structured._engines[0].compile
    monkeypatch.setattr(
        engine.structured._engines[0],
        "compile",
        lambda prepared: release.wait(30) and compile_for_real(prepared),
    )
    engine.add_request(
        "slow", PROMPTS[0], SamplingParams(max_tokens=8, structured_outputs={"regex": "[a-z]+"})
    )
    engine.add_request("plain", PROMPTS[1], SamplingParams(max_tokens=8, ignore_eos=True))
    finished = {}
    for _ in range(30):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if "plain" in finished:
            break
    assert "plain" in finished and "slow" not in finished
    assert engine.structured.num_parked == 1
    assert engine.scheduler.num_unfinished == 0  # the parked request is not in the scheduler
    release.set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert re.fullmatch("[a-z]+", finished["slow"].outputs[0].text)
    llm.check_kv_integrity()


def test_aborting_a_request_parked_or_running_frees_everything(text_model_dir, monkeypatch):
    llm = LLM(str(text_model_dir), dtype="float32")
    engine = llm.llm_engine
    release = threading.Event()
    structured = engine.structured
    compile_for_real = structured._engines[0].compile
    monkeypatch.setattr(
        structured._engines[0], "compile", lambda p: release.wait(30) and compile_for_real(p)
    )
    engine.add_request("parked", PROMPTS[0], SamplingParams(structured_outputs={"regex": "[0-9]+"}))
    engine.step()
    assert structured.num_parked == 1
    engine.abort_request(["parked"])
    assert structured.num_parked == 0 and not engine.has_unfinished_requests()
    release.set()
    engine.add_request("running", PROMPTS[0], SamplingParams(structured_outputs={"json": PERSON}))
    while not structured._samples:
        engine.step()
    engine.abort_request(["running"])
    assert not structured._samples and not engine.has_unfinished_requests()
    llm.check_kv_integrity()
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_token_outside_the_grammar_fails_only_its_request(text_model_dir):
    """A backend whose mask does nothing lets the model leave the grammar: the engine notices,
    fails that request with the reason, frees its blocks and serves the others."""
    llm = LLM(str(text_model_dir), dtype="float32")
    llm.llm_engine.runner.step_sampler.sampler.apply_bitmask = lambda logits, bitmask, rows: None
    outputs = llm.generate(
        [PROMPTS[0], PROMPTS[0]],
        [
            SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"regex": "Z+"}),
            SamplingParams(temperature=0.0, max_tokens=8),
        ],
        use_tqdm=False,
    )
    failed, served = outputs
    assert failed.error and "outside the structured_outputs grammar" in failed.error
    assert served.error is None and len(served.outputs[0].token_ids) == 8
    llm.check_kv_integrity()
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_constraint_applies_only_once_the_reasoning_ended(text_model_dir, plain):
    """With a reasoning parser the output is free until the end-of-reasoning tokens, then
    constrained; a prompt that already closed the reasoning is constrained from the start."""
    prompt = PROMPTS[0]
    free = plain.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    free_tokens = free[0].outputs[0].token_ids
    end_token = free_tokens[2]  # the greedy output "ends its reasoning" at its third token

    @register_reasoning_parser(f"ends-at-{end_token}")
    class EndsAtToken(ReasoningParser):
        end_token_ids = (end_token,)

    llm = LLM(str(text_model_dir), dtype="float32", reasoning_parser=f"ends-at-{end_token}")
    digits = SamplingParams(
        temperature=0.0, max_tokens=12, structured_outputs={"regex": "[0-9]{5}"}
    )
    output = llm.generate(prompt, digits, use_tqdm=False)[0].outputs[0]
    content_start = free_tokens.index(end_token) + 1
    assert output.token_ids[:content_start] == free_tokens[:content_start]
    answer = llm.get_tokenizer().decode(output.token_ids[content_start:], skip_special_tokens=True)
    assert re.fullmatch("[0-9]{5}", answer), answer
    assert output.finish_reason == "stop"

    closed = {"prompt_token_ids": [*plain.get_tokenizer().encode(prompt), end_token]}
    output = llm.generate(closed, digits, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{5}", output.text), output.text
    llm.check_kv_integrity()


def test_length_bounded_strings_go_to_llguidance_under_auto(text_model_dir, plain):
    """xgrammar 0.2 lets a string with maxLength hold raw control characters (invalid JSON):
    ``auto`` sends such a schema to llguidance, ``xgrammar`` alone refuses it."""
    schema = {
        "type": "object",
        "properties": {"maxLength": {"type": "string", "maxLength": 5}},
        "required": ["maxLength"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=0.8,
        seed=3,
        n=4,
        max_tokens=40,
        structured_outputs={"json": schema, "disable_any_whitespace": True},
    )
    for sample in plain.generate(PROMPTS, params, use_tqdm=False)[0].outputs:
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), schema)  # strict: no raw control characters
    only_xgrammar = LLM(str(text_model_dir), dtype="float32", structured_outputs_backend="xgrammar")
    with pytest.raises(InvalidRequestError, match="control characters"):
        only_xgrammar.generate(PROMPTS[0], params, use_tqdm=False)
    named_like_a_keyword = {"type": "object", "properties": {"maxLength": {"type": "integer"}}}
    only_xgrammar.llm_engine.structured.check(StructuredOutputsParams(json=named_like_a_keyword))


def test_rows_of_drafts_past_the_end_of_the_reasoning_are_constrained(text_model_dir):
    """Drafts that end the reasoning: the rows before the end stay free, the rows after it get
    the grammar's masks from its start, draft by draft."""
    from transformers import AutoTokenizer

    from platform_core.scheduler.output import ScheduledRequest
    from platform_core.structured_output.manager import StructuredOutputManager

    tokenizer = AutoTokenizer.from_pretrained(text_model_dir)
    ids = {text: tokenizer.encode(text) for text in ("a", "b", "#", "1", "2")}
    assert all(len(v) == 1 for v in ids.values())
    a, b, end, one, two = (v[0] for v in ids.values())

    class EndsAtHash(ReasoningParser):
        end_token_ids = (end,)

    manager = StructuredOutputManager("xgrammar", tokenizer, 320, [2], EndsAtHash(tokenizer))
    digits = StructuredOutputsParams(regex="[0-9]{2}")
    item = ScheduledRequest(
        request_id="r",
        token_ids=[b, end, one, two],
        start_position=5,
        block_ids=[],
        sample=True,
        sampling_params=SamplingParams(structured_outputs=digits),
        prompt_token_ids=[a],
        output_token_ids=[a, b],
        num_draft_tokens=3,
    )
    manager.check(digits)
    manager._compile(digits).result()
    manager.fill_bitmasks([item])
    rows = item.token_bitmask
    assert rows.shape == (4, 10)
    assert (rows[0] == -1).all()  # the token after "b": still reasoning
    reference = manager._compiled[digits.key].result().matcher()
    expected = torch.full((4, 10), -1, dtype=torch.int32)
    reference.fill_bitmask(expected, 1)  # after "#": the grammar's start
    assert reference.accept_token(one)
    reference.fill_bitmask(expected, 2)
    assert reference.accept_token(two)
    reference.fill_bitmask(expected, 3)  # the regex is complete: only the end is left
    assert torch.equal(rows, expected)
    assert not (rows[1:] == -1).all(dim=1).any()


def test_a_stop_string_ends_a_constrained_output(plain):
    params = SamplingParams(
        temperature=0.0, max_tokens=20, stop=["bbb"], structured_outputs={"regex": "ab{5}c"}
    )
    output = plain.generate(PROMPTS, params, use_tqdm=False)[0].outputs[0]
    assert (output.text, output.finish_reason, output.stop_reason) == ("a", "stop", "bbb")
    plain.check_kv_integrity()
    assert plain.stats()["kv_blocks_used"] == 0
