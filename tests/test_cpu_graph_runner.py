"""CPU graph runner: one-token steps replay a trace of the forward and match eager runs."""

from __future__ import annotations

import pytest
import torch
from platform_core_cpu.graph_runner import GRAPHS_ENV, CpuGraphRunner

from platform_core import LLM, SamplingParams
from platform_core.attention.metadata import AttentionMetadata
from platform_core.bench.random_model import RandomLlamaSpec, build_random_llama

SPEC = RandomLlamaSpec(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=256,
    dtype="bfloat16",
)
PROMPTS = [{"prompt_token_ids": [5 + i, 40, 17, 99, 12 + 3 * i]} for i in range(3)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_random_llama(tmp_path_factory.mktemp("graph-model"), SPEC))


def make_llm(model_dir: str, **kwargs) -> LLM:
    return LLM(
        model_dir,
        dtype="bfloat16",
        block_size=8,
        max_model_len=128,
        kv_cache_memory_bytes=1 << 22,
        seed=0,
        **kwargs,
    )


def test_one_token_steps_replay_the_trace_and_match_eager(model_dir):
    graphs, eager = make_llm(model_dir), make_llm(model_dir, enforce_eager=True)
    runner = graphs.engine.runner.graph_runner
    assert isinstance(runner, CpuGraphRunner) and sorted(runner.traces) == [1]
    assert eager.engine.runner.graph_runner is None
    # Different lengths: the batch shrinks to one request, whose steps then replay the trace
    # while its context crosses several 8-token blocks.
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 60)]
    got = graphs.generate(PROMPTS, params, use_tqdm=False)
    want = eager.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert runner.replays >= 50


def test_graphs_are_off_when_asked(model_dir, monkeypatch):
    monkeypatch.setenv(GRAPHS_ENV, "0")
    assert make_llm(model_dir).engine.runner.graph_runner is None


class ReadsData(torch.nn.Module):
    """A forward that branches on a token's value: a trace would freeze the branch taken."""

    def forward(self, input_ids, positions, kv_caches, metadata: AttentionMetadata):
        return input_ids.float() + 1 if bool(input_ids.sum() > 0) else input_ids.float() - 1


def test_a_forward_that_reads_data_in_python_runs_eagerly(caplog):
    model = ReadsData()
    runner = CpuGraphRunner(model, [], block_size=8, max_blocks=4)
    runner.capture()
    assert runner.traces == {}
    assert "run eagerly" in caplog.text
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.tensor([0]),
        max_query_len=1,
        max_seq_len=1,
        block_size=8,
        query_start_loc_cpu=[0, 1],
        seq_lens_cpu=[1],
    )
    for token, expected in ((3, 4.0), (0, -1.0)):
        out = runner(torch.tensor([token]), torch.tensor([0]), runner.kv_caches, metadata)
        assert out.item() == expected
    assert runner.replays == 0
