"""Prefill/decode disaggregation in one process: a producer engine computes prompts' KV, a
consumer engine loads the blocks it lacks (loopback and fault-injecting connectors) and must
generate exactly what one colocated engine generates. After every test both sides have every
block back (``settle``)."""

from __future__ import annotations

import pytest

from platform_core import LLM, SamplingParams
from platform_core.errors import ConfigError, InvalidRequestError
from tests.kv_transfer_utils import (
    COMMON,
    GREEDY,
    connector_llm,
    decode,
    prefill,
    prompt_of,
    settle,
    tokens,
)

BLOCK = COMMON["block_size"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tiny_model_dir):
    return tiny_model_dir(request.param)


@pytest.fixture(scope="module")
def colocated(model):
    return LLM(str(model), backend="cpu", **COMMON)


@pytest.fixture(scope="module")
def producer(model):
    llm = connector_llm(model, "kv_producer", max_num_batched_tokens=32)  # chunked prefill on P
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module", params=["cpu", "template"])
def consumer(request, model):
    """Consumers on the producer's backend and on one with another KV layout."""
    llm = connector_llm(model, "kv_consumer", backend=request.param)
    yield llm
    llm.engine.shutdown()


def reference(colocated: LLM, prompt: list[int], params: SamplingParams = GREEDY):
    colocated.reset_prefix_cache()
    return tokens(colocated.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0])


@pytest.mark.parametrize("length", [5, BLOCK, 3 * BLOCK, 3 * BLOCK + 1, 100])
def test_disaggregated_tokens_equal_colocated(colocated, producer, consumer, length):
    prompt = prompt_of(length, start=length)
    consumer.reset_prefix_cache()
    before = consumer.engine.stats()["kv_transfer_loaded_tokens"]
    kv_params = prefill(producer, f"p-{length}", prompt)
    loadable = length - 1  # all but the last token, computed on the consumer for its logits
    assert kv_params["remote_num_tokens"] == loadable
    output = decode(consumer, f"d-{length}", prompt, GREEDY, kv_params)
    assert tokens(output) == reference(colocated, prompt)
    assert consumer.engine.stats()["kv_transfer_loaded_tokens"] - before == loadable
    settle(producer)
    settle(consumer)


def test_n_samples_fork_from_loaded_blocks(colocated, producer, consumer):
    prompt = prompt_of(40, start=11)
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6, ignore_eos=True)
    consumer.reset_prefix_cache()
    output = decode(consumer, "d-n", prompt, params, prefill(producer, "p-n", prompt))
    assert tokens(output) == reference(colocated, prompt, params)
    settle(producer)
    settle(consumer)


@pytest.mark.parametrize(("length", "loaded_blocks"), [(3 * BLOCK + 1, 0), (3 * BLOCK + 2, 1)])
def test_prompt_cached_on_the_consumer(colocated, producer, consumer, length, loaded_blocks):
    """Three blocks cached there: with one more token (the last, computed there) nothing is
    fetched; with two, only the partial fourth block."""
    prompt = prompt_of(length, start=21)
    consumer.reset_prefix_cache()
    consumer.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)  # now cached there
    stats = consumer.engine.stats()
    output = decode(consumer, "d-cached", prompt, GREEDY, prefill(producer, "p-cached", prompt))
    assert tokens(output) == reference(colocated, prompt)
    after = consumer.engine.stats()
    received = after["kv_transfer_blocks_received"] - stats["kv_transfer_blocks_received"]
    assert received == loaded_blocks
    settle(producer)  # fetched or not, the consumer told the producer to free its copy
    assert producer.engine.stats()["kv_transfer_hold_timeouts"] == 0
    settle(consumer)


def test_partially_cached_prompt_loads_only_the_missing_blocks(colocated, producer, consumer):
    prompt = prompt_of(5 * BLOCK + 3, start=31)
    consumer.reset_prefix_cache()
    consumer.generate({"prompt_token_ids": prompt[: 2 * BLOCK + 1]}, GREEDY, use_tqdm=False)
    before = consumer.engine.stats()["kv_transfer_blocks_received"]
    output = decode(consumer, "d-part", prompt, GREEDY, prefill(producer, "p-part", prompt))
    assert tokens(output) == reference(colocated, prompt)
    # Blocks 0-1 cached there; 2-5 loaded (5 partly: the last token is computed there).
    assert consumer.engine.stats()["kv_transfer_blocks_received"] - before == 4
    settle(producer)
    settle(consumer)


def test_params_without_a_connector_are_refused(colocated):
    with pytest.raises(InvalidRequestError, match="no KV connector"):
        colocated.engine.add_request(
            "x", None, GREEDY, prompt_token_ids=[1, 2, 3], kv_transfer_params={"a": 1}
        )


def test_a_connector_needs_one_rank_and_a_known_name(tiny_model_dir):
    model = tiny_model_dir("llama")
    with pytest.raises(ConfigError, match="unknown KV connector 'nope'"):
        connector_llm(model, "kv_producer", connector="nope")
    with pytest.raises(ConfigError, match="tensor_parallel_size 1"):
        connector_llm(model, "kv_producer", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="data_parallel_size 1"):
        connector_llm(model, "kv_producer", data_parallel_size=2)
    with pytest.raises(ConfigError, match="fixed kv_port"):
        connector_llm(model, "kv_producer", connector="tcp", transfer={"kv_port": 0})


# ---------------------------------------------------------------------------- failures
def faulty_consumer(model, **faults) -> LLM:
    return connector_llm(
        model, "kv_consumer", connector="faults", transfer={"kv_connector_extra_config": faults}
    )


OFFERED = 4 * BLOCK + 4  # a prompt of 4 * BLOCK + 5 tokens: five blocks, the last partial


@pytest.mark.parametrize(
    ("faults", "loaded"),
    [
        ({"fail_fetches": 1}, 0),  # the connection is lost: everything recomputed
        ({"corrupt_positions": [2]}, 2 * BLOCK),  # block 2 damaged: 0-1 kept, 2 on recomputed
        ({"missing_positions": [0]}, 0),
        ({"missing_positions": [4]}, 4 * BLOCK),  # only the partial last block is lost
        ({"delay_s": 0.3}, OFFERED),  # slow, but complete
    ],
)
def test_failed_loads_fall_back_to_recompute(colocated, producer, model, faults, loaded):
    consumer = faulty_consumer(model, **faults)
    prompt = prompt_of(4 * BLOCK + 5, start=41)
    output = decode(consumer, "d-f", prompt, GREEDY, prefill(producer, "p-f", prompt))
    assert tokens(output) == reference(colocated, prompt)
    stats = consumer.engine.stats()
    assert stats["kv_transfer_loaded_tokens"] == loaded
    assert stats["kv_transfer_recomputed_tokens"] == OFFERED - loaded
    settle(producer)
    settle(consumer)
    consumer.engine.shutdown()


def test_checksums_are_what_catches_damaged_blocks(colocated, model):
    """Without the producer's checksums a damaged block is imported, and the tokens change:
    the equality checks above do see a bad transfer."""
    producer = connector_llm(
        model, "kv_producer", transfer={"kv_connector_extra_config": {"verify_checksums": False}}
    )
    consumer = faulty_consumer(model, corrupt_positions=[0, 1, 2, 3, 4])
    prompt = prompt_of(4 * BLOCK + 5, start=51)
    output = decode(consumer, "d-c", prompt, GREEDY, prefill(producer, "p-c", prompt))
    assert consumer.engine.stats()["kv_transfer_loaded_tokens"] == OFFERED
    assert tokens(output) != reference(colocated, prompt)
    settle(producer)
    settle(consumer)
    for llm in (producer, consumer):
        llm.engine.shutdown()


def test_producer_frees_blocks_when_the_consumer_never_confirms(model):
    producer = connector_llm(model, "kv_producer", transfer={"kv_hold_timeout_s": 0.3})
    consumer = faulty_consumer(model, drop_confirms=True)
    prompt = prompt_of(3 * BLOCK + 2, start=61)
    decode(consumer, "d-t", prompt, GREEDY, prefill(producer, "p-t", prompt))
    assert producer.engine.stats()["kv_transfer_held"] == 1
    settle(producer)  # freed by the timeout
    assert producer.engine.stats()["kv_transfer_hold_timeouts"] == 1
    settle(consumer)
    for llm in (producer, consumer):
        llm.engine.shutdown()


def test_producer_gone_before_the_load(colocated, model):
    producer = connector_llm(model, "kv_producer")
    consumer = connector_llm(model, "kv_consumer")
    prompt = prompt_of(3 * BLOCK + 2, start=71)
    kv_params = prefill(producer, "p-gone", prompt)
    producer.engine.shutdown()
    output = decode(consumer, "d-gone", prompt, GREEDY, kv_params)
    assert tokens(output) == reference(colocated, prompt)
    assert consumer.engine.stats()["kv_transfer_recomputed_tokens"] == 3 * BLOCK + 1
    settle(consumer)
    consumer.engine.shutdown()


def test_consumer_aborts_while_loading(colocated, producer, model):
    consumer = faulty_consumer(model, delay_s=0.3)
    engine = consumer.engine
    prompt = prompt_of(3 * BLOCK + 2, start=81)
    kv_params = prefill(producer, "p-abort", prompt)
    engine.add_request(
        "d-abort", None, GREEDY, prompt_token_ids=prompt, kv_transfer_params=kv_params
    )
    engine.step()
    assert engine.stats()["kv_transfer_loading"] == 1
    assert engine.stats()["num_running"] == 0  # waiting for its blocks, not running
    # Others are not held up by the loading request.
    other = prompt_of(10, start=91)
    engine.add_request("other", None, GREEDY, prompt_token_ids=other)
    engine.step()
    assert engine.stats()["num_running"] == 1
    engine.abort_request(["d-abort"])
    assert engine.stats()["kv_blocks_used"] > 0  # still being written: not freed yet
    while engine.has_unfinished_requests():
        engine.step()
    settle(producer)
    settle(consumer)  # freed once the load ended
    consumer.engine.shutdown()


@pytest.mark.parametrize("connector", ["tcp", "shm"])
def test_socket_and_shared_memory_connectors_pair_engines(colocated, model, connector):
    from server_utils import free_port

    producer = connector_llm(
        model, "kv_producer", connector=connector, transfer={"kv_port": free_port()}
    )
    consumer = connector_llm(model, "kv_consumer", connector=connector, backend="template")
    prompt = prompt_of(5 * BLOCK + 7, start=101)
    output = decode(consumer, "d-net", prompt, GREEDY, prefill(producer, "p-net", prompt))
    assert tokens(output) == reference(colocated, prompt)
    stats = consumer.engine.stats()
    assert stats["kv_transfer_blocks_received"] == 6  # 86 tokens: the sixth block partly
    assert 0 < stats["kv_transfer_latency_p50_s"] <= stats["kv_transfer_latency_p99_s"]
    settle(producer)  # its next steps report what it served
    assert stats["kv_transfer_bytes_received"] == producer.engine.stats()["kv_transfer_bytes_sent"]
    settle(consumer)
    for llm in (producer, consumer):
        llm.engine.shutdown()


def test_a_large_load_lands_over_several_steps(colocated, producer, model):
    """One block per step (``import_bytes_per_step`` below a block): the blocks land a step at
    a time, so requests decoding meanwhile are never held up by the whole prompt's copy."""
    consumer = connector_llm(
        model, "kv_consumer", transfer={"kv_connector_extra_config": {"import_bytes_per_step": 1}}
    )
    engine = consumer.engine
    prompt = prompt_of(5 * BLOCK + 3, start=111)
    kv_params = prefill(producer, "p-slow", prompt)
    engine.add_request(
        "d-slow", None, GREEDY, prompt_token_ids=prompt, kv_transfer_params=kv_params
    )
    received = []
    while engine.stats()["kv_transfer_loading"] or not received:
        engine.step()
        received.append(engine.stats()["kv_transfer_blocks_received"])
    assert received[-1] == 6 and len(set(received)) >= 6  # one more block each step
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert tokens(final) == reference(colocated, prompt)
    settle(producer)
    settle(consumer)
    engine.shutdown()
