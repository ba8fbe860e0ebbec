"""The OpenAI-compatible server driven by the real ``openai`` client on a loopback port.

Longer than our ~250-line norm on purpose: every check here shares one module-scoped server (and
one offline ``LLM`` to compare with), and each further module would start another.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import MODEL_NAME, engine_config

from platform_core import LLM, SamplingParams, __version__

PROMPTS = ["The capital of France is", "A quick brown fox", "Paged attention keeps"]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "The capital of Italy is"},
]


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(config=engine_config(model_dir))


def _generate(llm, prompts, **params):
    outputs = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [[c.text for c in o.outputs] for o in outputs]


def _chat_prompt_ids(llm):
    text = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_models_lists_the_served_model(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_dump()["max_model_len"] == engine.max_model_len


def test_greedy_completions_equal_llm_generate(client, llm):
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0
    )
    expected = _generate(llm, PROMPTS, temperature=0.0, max_tokens=12)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [[c.text] for c in response.choices] == expected
    prompt_tokens = sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    generated = sum(
        len(o.outputs[0].token_ids)
        for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
        )
    )
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == generated
    assert response.usage.total_tokens == prompt_tokens + generated


def test_token_id_prompts_complete_like_their_text(client, llm):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    as_text = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=8, temperature=0
    )
    as_lists = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    as_one = client.completions.create(model=MODEL_NAME, prompt=ids[0], max_tokens=8, temperature=0)
    assert [c.text for c in as_lists.choices] == [c.text for c in as_text.choices]
    assert as_one.choices[0].text == as_text.choices[0].text


def test_streamed_completion_reassembles_to_the_whole_one(client):
    whole = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0
    )
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[1],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishing[-1] == whole.choices[0].finish_reason and set(finishing[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_n_samples_per_prompt_are_indexed_and_seeded(client, llm):
    params = {"n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 10}
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], **params)
    assert [c.index for c in response.choices] == list(range(6))
    expected = _generate(llm, PROMPTS[:2], **params)
    got = [[c.text for c in response.choices[i * 3 : i * 3 + 3]] for i in range(2)]
    assert got == expected
    assert len(set(got[0])) > 1  # sampled, not three copies of one answer


def test_completion_logprobs_and_echo(client, llm):
    response = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3
    )
    expected = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(expected.token_ids) == 6
    for got, token_id, position in zip(
        logprobs.token_logprobs, expected.token_ids, expected.logprobs
    ):
        assert got == pytest.approx(position[token_id].logprob, abs=1e-5)
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        # The chosen token and the top 3, keyed by text (tokens that decode alike share a key).
        assert 1 <= len(top) <= 4 and max(top.values()) == pytest.approx(chosen)  # greedy
    assert logprobs.text_offset == sorted(logprobs.text_offset)

    echoed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=1, echo=True
    )
    choice = echoed.choices[0]
    assert choice.text == PROMPTS[0] + response.choices[0].text
    num_prompt = len(llm.tokenizer.encode(PROMPTS[0]))
    assert len(choice.logprobs.tokens) == num_prompt + 6
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    assert "".join(choice.logprobs.tokens[:num_prompt]) == PROMPTS[0]


def test_stop_strings_and_stop_token_ids(client, llm):
    full = _generate(llm, [PROMPTS[2]], temperature=0.0, max_tokens=24)[0][0]
    stop = full[6:8]
    assert stop.strip() and full.find(stop) >= 1
    cut = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.text == full[: full.find(stop)]
    assert cut.finish_reason == "stop" and cut.model_dump()["stop_reason"] == stop
    kept = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        max_tokens=24,
        temperature=0,
        stop=stop,
        extra_body={"include_stop_str_in_output": True},
    ).choices[0]
    assert kept.text == full[: full.find(stop) + len(stop)]

    tokens = (
        llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    by_token = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        max_tokens=24,
        temperature=0,
        extra_body={"stop_token_ids": [tokens[4]]},
    ).choices[0]
    assert by_token.finish_reason == "stop" and by_token.model_dump()["stop_reason"] == tokens[4]
    expected = _generate(
        llm, [PROMPTS[2]], temperature=0.0, max_tokens=24, stop_token_ids=[tokens[4]]
    )
    assert by_token.text == expected[0][0]


def test_vllm_sampling_extras_reach_the_sampler(client, llm):
    extras = {"top_k": 8, "min_p": 0.02, "repetition_penalty": 1.3, "min_tokens": 5}
    openai_params = {
        "seed": 5,
        "temperature": 0.9,
        "top_p": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.3,
        "logit_bias": {"70": 5.0},
    }
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        max_tokens=10,
        user="tester",
        extra_body=extras,
        **openai_params,
    )
    params = {**extras, **openai_params, "logit_bias": {70: 5.0}, "max_tokens": 10}
    assert response.choices[0].text == _generate(llm, [PROMPTS[0]], **params)[0][0]
    plain = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=10, seed=5, temperature=0.9
    )
    assert plain.choices[0].text != response.choices[0].text


def test_chat_applies_the_template_and_equals_llm_generate(client, llm, base_url):
    prompt_ids = _chat_prompt_ids(llm)
    bos = llm.tokenizer.bos_token_id
    assert prompt_ids[0] == bos and prompt_ids[1] != bos  # the template's BOS, not doubled
    tokenized = httpx.post(base_url + "/tokenize", json={"messages": MESSAGES}).json()
    assert tokenized["tokens"] == prompt_ids

    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_completion_tokens=12, temperature=0
    )
    expected = _generate(llm, [{"prompt_token_ids": prompt_ids}], temperature=0.0, max_tokens=12)
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected[0][0]
    assert response.usage.prompt_tokens == len(prompt_ids)


def test_chat_streaming_logprobs_and_n(client, llm):
    whole = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token

    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_tokens=10,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        deltas = [ch.delta for c in chunks for ch in c.choices if ch.index == index]
        assert deltas[0].role == "assistant"
        assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 2 * whole.usage.completion_tokens


def test_usage_counts_prefix_cache_hits(client):
    prompt = "Continuous batching keeps the accelerator busy; paged attention keeps memory tidy. "
    prompt = prompt * 2 + "And again:"
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens >= 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_tokenize_detokenize_and_version(base_url, llm):
    text = "Grüße aus Köln!"
    tokens = httpx.post(base_url + "/tokenize", json={"prompt": text}).json()
    assert tokens["tokens"] == llm.tokenizer.encode(text) and tokens["count"] == len(
        tokens["tokens"]
    )
    back = httpx.post(base_url + "/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}
    assert httpx.get(base_url + "/version").json() == {"version": __version__}
    assert httpx.get(base_url + "/health").status_code == 200


def _metrics(base_url) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics").text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels or sample.labels.get("le") is None
    }


def test_metrics_follow_requests(client, base_url):
    before = _metrics(base_url)
    response = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = _metrics(base_url)

    def grew(name):
        return after[name] - before.get(name, 0.0)

    assert grew("platform_core_prompt_tokens_total") == response.usage.prompt_tokens
    assert grew("platform_core_generation_tokens_total") == 7
    assert grew("platform_core_time_to_first_token_seconds_count") == 1
    assert grew("platform_core_e2e_request_latency_seconds_count") == 1
    assert grew("platform_core_inter_token_latency_seconds_count") <= 6
    assert after["platform_core_num_requests_running"] == 0
    assert after["platform_core_kv_cache_usage_perc"] == 0
    assert 0 <= after["platform_core_prefix_cache_hit_rate"] <= 1
    assert "platform_core_num_preemptions_total" in after


def test_stream_events_stay_one_line_whatever_the_text_holds():
    import json

    from platform_core.entrypoints.openai.responses import sse_data

    text = "line\u2028separator\x85next\u2029paragraph\nnewline"
    event = sse_data(json.dumps({"text": text}, ensure_ascii=False))
    lines = event.splitlines()  # how httpx, and so the OpenAI SDK, splits a stream into lines
    assert lines[0].startswith("data: ") and lines[1:] == [""]
    assert json.loads(lines[0][len("data: ") :]) == {"text": text}
