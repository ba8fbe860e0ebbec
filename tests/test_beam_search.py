"""Beam search: ``LLM.beam_search`` and ``use_beam_search`` over HTTP.

Correctness is checked against Hugging Face transformers' own beam search
(``generate(num_beams=k, num_return_sequences=k, do_sample=False, length_penalty, early_stopping)``)
on the same tiny model: our selection follows its rules, so the beams' tokens and scores must be
equal, including beams that end in EOS. The EOS id is chosen so that it really is among the best
continuations (a random model otherwise almost never ends a beam).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from platform_core import LLM
from platform_core.engine.beam_search import BeamSearchParams
from platform_core.errors import InvalidRequestError

PROMPTS = [list(range(3, 24)), [5, 9, 200, 31, 7, 7, 100], list(range(50, 90))]
MAX_TOKENS = 10


def _hf_beams(model, prompt, k, length_penalty, early_stopping, eos, max_tokens=MAX_TOKENS):
    """transformers' best ``k`` beams of ``prompt``: (generated tokens up to EOS, score)."""
    out = model.generate(
        torch.tensor([prompt]),
        num_beams=k,
        num_return_sequences=k,
        max_new_tokens=max_tokens,
        do_sample=False,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    beams = []
    for tokens, score in zip(out.sequences, out.sequences_scores):
        generated = tokens[len(prompt) :].tolist()
        if eos in generated:
            generated = generated[: generated.index(eos) + 1]
        beams.append((generated, float(score)))
    return beams


@pytest.fixture(scope="module")
def eos_model(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with an EOS id that transformers' beams pass through at step 2; its dir,
    the EOS id and the HF model loaded from that dir."""
    from transformers import AutoModelForCausalLM

    source = tiny_model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    [(tokens, _), *_] = _hf_beams(model, PROMPTS[0], 3, 1.0, False, eos=None)
    eos = tokens[1]
    path = tmp_path_factory.mktemp("tiny-llama-eos")
    shutil.copytree(source, path, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = eos
        (path / name).write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == eos
    return path, eos, model


@pytest.fixture(scope="module")
def eos_llm(eos_model):
    return LLM(str(eos_model[0]), dtype="float32", kv_cache_memory_bytes=1 << 22, block_size=16)


CASES = [(3, 1.0, False), (4, 0.5, True), (2, 2.0, "never"), (3, -1.0, False), (5, 1.0, "never")]


def test_beams_equal_transformers_beam_search(eos_model, eos_llm):
    _, eos, hf = eos_model
    finish_reasons = set()
    for k, length_penalty, early_stopping in CASES:
        params = BeamSearchParams(
            beam_width=k,
            max_tokens=MAX_TOKENS,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        outputs = eos_llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        for prompt, output in zip(PROMPTS, outputs):
            expected = _hf_beams(hf, prompt, k, length_penalty, early_stopping, eos)
            got = []
            for seq in output.sequences:
                generated = seq.tokens[len(prompt) :]
                assert seq.tokens[: len(prompt)] == prompt
                assert seq.finish_reason == ("stop" if generated[-1] == eos else "length")
                finish_reasons.add(seq.finish_reason)
                got.append((generated, seq.cum_logprob / len(generated) ** length_penalty))
            case = (k, length_penalty, early_stopping, prompt)
            assert [g for g, _ in got] == [e for e, _ in expected], case
            assert [s for _, s in got] == pytest.approx([s for _, s in expected], abs=1e-4), case
    assert finish_reasons == {"stop", "length"}  # both ways of ending a beam were compared
    eos_llm.check_kv_integrity()
    assert eos_llm.stats()["kv_blocks_used"] == 0


def test_ignore_eos_runs_every_beam_to_max_tokens(eos_model, eos_llm):
    _, eos, hf = eos_model
    hf.generation_config.eos_token_id = None  # transformers without EOS: what ignore_eos means
    try:
        expected = _hf_beams(hf, PROMPTS[0], 3, 1.0, False, eos=None)
    finally:
        hf.generation_config.eos_token_id = eos
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    [output] = eos_llm.beam_search({"prompt_token_ids": PROMPTS[0]}, params)
    got = [seq.tokens[len(PROMPTS[0]) :] for seq in output.sequences]
    assert got == [tokens for tokens, _ in expected]
    assert any(eos in tokens for tokens in got)  # EOS was generated and did not end the beam
    assert all(seq.finish_reason == "length" for seq in output.sequences)


def test_beams_share_prefix_blocks(tiny_model_dir):
    """Beams share their prompt's KV blocks through the prefix cache: the pool holds far fewer
    blocks than beams x blocks per beam, and each round recomputes at most a block per beam."""
    llm = LLM(
        str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory_bytes=1 << 22, block_size=16
    )
    scheduler = llm.engine.scheduler
    peak = 0
    schedule = scheduler.schedule

    def recording_schedule():
        nonlocal peak
        out = schedule()
        peak = max(peak, scheduler.kv_stats().num_used_blocks)
        return out

    scheduler.schedule = recording_schedule
    prompt = list(range(3, 67))  # 64 tokens: 4 full blocks
    k, max_tokens = 4, 8
    before = llm.stats()
    [output] = llm.beam_search(
        {"prompt_token_ids": prompt},
        BeamSearchParams(beam_width=k, max_tokens=max_tokens, ignore_eos=True),
    )
    after = llm.stats()
    assert len(output.sequences) == k
    blocks_per_beam = -(-(len(prompt) + max_tokens) // 16)  # 5
    assert peak <= 4 + k  # the 4 prompt blocks once, plus one tail block per beam
    assert peak < k * blocks_per_beam
    computed = after["num_scheduled_tokens"] - before["num_scheduled_tokens"]
    # Round 1 computes the prompt; each later round at most a block's worth per beam (the 64
    # prompt tokens are cache hits), where recomputing would cost ~68 tokens per beam.
    assert computed <= len(prompt) + (max_tokens - 1) * k * 16
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    assert hits >= (max_tokens - 1) * k * 64 - 64  # (round 2's last token is always computed)
    llm.check_kv_integrity()
    assert llm.stats()["kv_blocks_used"] == 0


def test_beam_search_params_are_validated(eos_llm):
    with pytest.raises(InvalidRequestError) as info:
        BeamSearchParams(beam_width=0, max_tokens=4)
    assert info.value.param == "beam_width"
    with pytest.raises(InvalidRequestError) as info:
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
    assert info.value.param == "early_stopping"
    with pytest.raises(InvalidRequestError) as info:  # 2 x 11 candidates > 20 logprobs
        eos_llm.beam_search({"prompt_token_ids": [5, 6]}, BeamSearchParams(11, 4))
    assert info.value.param == "beam_width" and "at most 10 beams" in str(info.value)
    with pytest.raises(InvalidRequestError):
        eos_llm.beam_search([[5, 6]], BeamSearchParams(2, 4))  # type: ignore[list-item]
    assert eos_llm.stats()["kv_blocks_used"] == 0


# ---------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def text_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def test_completion_beam_search_over_http(client, text_hf, engine):
    model, tokenizer = text_hf
    prompt = "The quick brown fox"
    response = client.completions.create(
        model="tiny-chat",
        prompt=prompt,
        n=3,
        max_tokens=6,
        temperature=0.0,
        extra_body={"use_beam_search": True, "length_penalty": 0.7},
    )
    ids = tokenizer(prompt)["input_ids"]
    eos = model.generation_config.eos_token_id
    expected = _hf_beams(model, ids, 3, 0.7, False, eos, max_tokens=6)
    assert [c.index for c in response.choices] == [0, 1, 2]
    texts = [c.text for c in response.choices]
    assert texts == [
        tokenizer.decode(t[:-1] if t[-1] == eos else t, skip_special_tokens=True)
        for t, _ in expected
    ]
    assert len(set(texts)) == 3
    assert response.usage.prompt_tokens == len(ids)
    assert response.usage.completion_tokens == sum(len(t) for t, _ in expected)
    assert engine.stats()["kv_blocks_used"] == 0


def test_chat_beam_search_over_http(client, engine):
    response = client.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "user", "content": "hello there"}],
        n=3,
        max_tokens=5,
        extra_body={"use_beam_search": True},
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.message.content for c in response.choices}) == 3
    assert all(c.finish_reason in ("stop", "length") for c in response.choices)
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"n": 11}, "n"),
        ({"length_penalty": "long"}, "length_penalty"),
    ],
)
def test_beam_search_bad_requests_are_400(base_url, extra, param, engine):
    body = {"prompt": "hi", "max_tokens": 3, "use_beam_search": True, **extra}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.stats()["kv_blocks_used"] == 0


def test_beam_search_past_its_timeout_is_aborted_and_frees_blocks(base_url, engine):
    from server_utils import engine_idle, wait_for

    body = {
        "prompt": "a long search",
        "n": 4,
        "max_tokens": 200,
        "ignore_eos": True,
        "use_beam_search": True,
        "timeout": 0.3,
    }
    started = time.monotonic()
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 408, response.text
    assert time.monotonic() - started < 5  # 200 rounds would take longer; it stopped at 0.3 s
    wait_for(lambda: engine_idle(engine), 5, "the aborted beam search left requests or blocks")
