"""Sampling through the engine: logprobs vs HF, stop strings, seeds, and n > 1 block sharing."""

from __future__ import annotations

import pytest
import torch
from text_model import save_text_model

from platform_core import LLM, SamplingParams


@pytest.fixture(scope="module")
def text_llm(tmp_path_factory):
    return LLM(str(save_text_model(tmp_path_factory.mktemp("text-llama"))), dtype="float32")


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return LLM(
        str(tiny_model_dir("llama")), dtype="float32", enable_prefix_caching=False, block_size=16
    )


def test_greedy_logprobs_match_hf(llama, hf_reference_model):
    prompt = [5, 17, 33, 2, 90, 41, 7, 7, 12]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3)
    out = llama.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    model = hf_reference_model("llama")
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    for step, position in enumerate(out.outputs[0].logprobs):
        row = reference[len(prompt) - 1 + step]
        token = tokens[step]
        assert abs(position[token].logprob - float(row[token])) < 1e-4
        assert position[token].rank == 1
        top5 = set(row.topk(5).indices.tolist())
        assert top5 <= set(position)  # the chosen token plus the top five
    cumulative = sum(float(reference[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens))
    assert abs(out.outputs[0].cumulative_logprob - cumulative) < 1e-3
    assert out.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        expected = float(reference[position - 1, prompt[position]])
        assert abs(entry[prompt[position]].logprob - expected) < 1e-4


def test_stop_string_across_token_boundary(text_llm):
    tokenizer = text_llm.tokenizer
    # Restrict output to multi-letter tokens so token boundaries fall between letters.
    words = [
        i
        for i in range(len(tokenizer))
        if len(tokenizer.decode([i]).strip()) >= 2 and tokenizer.decode([i]).strip().isalpha()
    ]
    base = SamplingParams(temperature=0.0, max_tokens=12, allowed_token_ids=words)
    full = text_llm.generate("The capital of", base, use_tqdm=False)[0].outputs[0]
    first_piece = tokenizer.decode(full.token_ids[:1])
    stop = full.text[len(first_piece) - 1 : len(first_piece) + 1]  # spans tokens 0 and 1
    first = full.text.find(stop)
    assert first <= len(first_piece) - 1
    params = SamplingParams(
        temperature=0.0, max_tokens=12, allowed_token_ids=words, stop=[stop, "never-matches"]
    )
    out = text_llm.generate("The capital of", params, use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(full.token_ids)
    params.include_stop_str_in_output = True
    out = text_llm.generate("The capital of", params, use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[: first + len(stop)]


def test_seed_is_invariant_to_batch_composition(llama):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=8, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    target = {"prompt_token_ids": [9, 8, 7, 6]}
    alone = llama.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    fillers = [{"prompt_token_ids": [i, i + 1, i + 2]} for i in range(10, 60, 10)]
    batch = llama.generate(
        [fillers[0], fillers[1], target, *fillers[2:]],
        [other, other, seeded, other, other, other],
        use_tqdm=False,
    )
    assert batch[2].outputs[0].token_ids == alone
    reordered = llama.generate([target, *fillers], [seeded] + [other] * 5, use_tqdm=False)
    assert reordered[0].outputs[0].token_ids == alone


def test_n_samples_share_prompt_blocks_and_compute_it_once(llama):
    engine = llama.engine
    kv = engine.scheduler.kv
    prompt = list(range(3, 43))  # 40 tokens: two full 16-token blocks and a partial one
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    single = llama.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]
    tokens_before = engine.scheduler.stats.num_scheduled_tokens

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=3)
    engine.add_request("fork", None, params, prompt_token_ids=prompt)
    engine.step()  # the whole prompt, once, then three first tokens
    assert engine.scheduler.stats.num_scheduled_tokens - tokens_before == len(prompt)
    tables = [kv.block_ids(rid) for rid in ("fork", "fork#1", "fork#2")]
    shared = tables[0][:2]
    assert all(t[:2] == shared for t in tables)
    assert all(kv.pool.ref_counts[b] == 3 for b in shared)
    partials = {t[2] for t in tables}
    assert len(partials) == 3  # the partial block was copied, each sample writes its own
    kv.check_integrity()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and [o.index for o in final.outputs] == [0, 1, 2]
    for completion in final.outputs:
        assert completion.token_ids == single.outputs[0].token_ids
    assert kv.pool.num_used_blocks == 0
    kv.check_integrity()


def test_n_samples_with_temperature_differ_and_are_reproducible(llama):
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=4, seed=5)
    first = llama.generate({"prompt_token_ids": [4, 5, 6]}, params, use_tqdm=False)[0]
    again = llama.generate({"prompt_token_ids": [4, 5, 6]}, params, use_tqdm=False)[0]
    samples = [o.token_ids for o in first.outputs]
    assert samples == [o.token_ids for o in again.outputs]
    assert len({tuple(s) for s in samples}) > 1


def test_min_tokens_and_stop_token_ids(llama):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = llama.generate({"prompt_token_ids": [11, 12]}, greedy, use_tqdm=False)[0]
    first_token = tokens.outputs[0].token_ids[0]
    stop = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first_token])
    out = llama.generate({"prompt_token_ids": [11, 12]}, stop, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first_token] and out.finish_reason == "stop"
    assert out.stop_reason == first_token
    held = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first_token], min_tokens=3)
    out = llama.generate({"prompt_token_ids": [11, 12]}, held, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 3 and first_token not in out.token_ids[:3]


def test_forks_that_finish_on_their_first_token(llama):
    params = SamplingParams(temperature=1.0, n=3, max_tokens=1, seed=1)
    out = llama.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0]
    assert [len(o.token_ids) for o in out.outputs] == [1, 1, 1]
    assert all(o.finish_reason == "length" for o in out.outputs)
    assert llama.stats()["kv_blocks_used"] == 0


def test_length_limit_wins_over_min_tokens(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", max_model_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=100, min_tokens=100)
    out = llm.generate({"prompt_token_ids": list(range(3, 33))}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10  # the context is full at 40 tokens
    assert out.outputs[0].finish_reason == "length"
