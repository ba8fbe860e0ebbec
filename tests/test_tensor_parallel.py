"""Tensor-parallel models: two gloo ranks on loopback against the single-process model.

Each rank loads its shard (recording every read of the checkpoint) and the whole model, runs the
same prefill and decode steps through both with the reference attention ops and its own KV cache
of its own KV heads, and checks the logits, the shard shapes, the shard contents and that only
its rows/columns of each checkpoint tensor were read. Head-count errors are checked in-process.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig

from platform_core.attention.reference import ReferenceAttentionOps
from platform_core.distributed.communicator import Communicator
from platform_core.distributed.parallel_state import TPGroup
from platform_core.errors import ConfigError
from platform_core.models import loader
from platform_core.models.loader import load_model
from platform_core.models.registry import check_tensor_parallel
from tests.conftest import _randomize, tiny_hf_config
from tests.multiproc import run_ranks
from tests.test_models import PagedRunner

TP = 2
CPU = torch.device("cpu")
# conftest models (sharded KV heads, tied embeddings, o_proj/down_proj biases, q/k/v biases,
# per-head q/k norms) plus one with a single KV head (replicated) and an odd vocabulary (padded)
SHARED_MODELS = ("llama", "llama_tied", "llama_bias_linear_rope", "qwen2", "qwen3")
MQA_ODD_VOCAB = {"num_key_value_heads": 1, "vocab_size": 251}


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    # imported here: the ranks import this module, and this import alone takes seconds
    from transformers import AutoModelForCausalLM

    dirs = {name: tiny_model_dir(name) for name in SHARED_MODELS}
    config = tiny_hf_config("llama")
    for key, value in MQA_ODD_VOCAB.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed=11)
    dirs["llama_mqa_odd_vocab"] = tmp_path_factory.mktemp("tiny-llama-mqa")
    model.save_pretrained(dirs["llama_mqa_odd_vocab"], safe_serialization=True)
    return dirs


# ---------------------------------------------------------------- recording checkpoint reads


class _RecordingSlice:
    """A safetensors slice handle that records the shape of every read."""

    def __init__(self, name: str, handle: Any, reads: list[tuple[str, tuple[int, ...]]]) -> None:
        self._name, self._handle, self._reads = name, handle, reads

    def get_shape(self) -> list[int]:
        return self._handle.get_shape()

    def get_dtype(self) -> str:
        return self._handle.get_dtype()

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self._handle[index]
        self._reads.append((self._name, tuple(tensor.shape)))
        return tensor


class _RecordingFile:
    """A ``safe_open`` handle offering only lazy slices (no ``get_tensor``), recorded."""

    def __init__(self, handle: Any, reads: list[tuple[str, tuple[int, ...]]]) -> None:
        self._handle, self._reads = handle, reads

    def __enter__(self) -> _RecordingFile:
        self._handle.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return self._handle.keys()

    def get_slice(self, name: str) -> _RecordingSlice:
        return _RecordingSlice(name, self._handle.get_slice(name), self._reads)


def _load_recording_reads(
    model_dir: Path, config: Any, tp: TPGroup
) -> tuple[Any, list[tuple[str, tuple[int, ...]]]]:
    reads: list[tuple[str, tuple[int, ...]]] = []
    real_open = loader.safe_open
    with mock.patch.object(
        loader, "safe_open", lambda *a, **k: _RecordingFile(real_open(*a, **k), reads)
    ):
        model = load_model(model_dir, config, torch.float32, CPU, ReferenceAttentionOps(), tp=tp)
    return model, reads


# ---------------------------------------------------------------- what one rank should hold


def _vocab_rows(vocab: int, rank: int) -> tuple[int, int]:
    """(first row, row count) of ``rank``'s vocabulary shard, padded to ``TP`` equal shards."""
    per_rank = -(-vocab // TP)
    return rank * per_rank, min(per_rank, vocab - rank * per_rank)


def _kv_heads(config: Any, rank: int) -> tuple[int, int]:
    """(first KV head, count) of ``rank``: split when >= TP heads, else replicated."""
    kv = config.num_key_value_heads
    if kv >= TP:
        return rank * kv // TP, kv // TP
    return rank // (TP // kv), 1


def _expected_read(name: str, shape: tuple[int, ...], config: Any, rank: int) -> tuple[int, ...]:
    """The part of checkpoint tensor ``name`` (full ``shape``) that ``rank`` must read."""
    if "q_proj" in name or "gate_proj" in name or "up_proj" in name:
        return (shape[0] // TP, *shape[1:])
    if "k_proj" in name or "v_proj" in name:
        head_size = shape[0] // config.num_key_value_heads
        return (_kv_heads(config, rank)[1] * head_size, *shape[1:])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return (shape[0], shape[1] // TP)
    if "embed_tokens" in name or "lm_head" in name:
        return (_vocab_rows(config.vocab_size, rank)[1], shape[1])
    return shape


def _check_shard_shapes_and_contents(shard: Any, full: Any, config: Any, rank: int) -> None:
    """The shard's head counts, parameter shapes, and rows/columns of the whole model's."""
    heads, hidden = config.num_attention_heads, config.hidden_size
    head_size = full.head_size
    first_kv, kv_count = _kv_heads(config, rank)
    q_size, kv_size = heads // TP * head_size, kv_count * head_size
    inter = config.intermediate_size // TP
    assert (shard.num_heads, shard.num_kv_heads) == (heads // TP, kv_count)
    assert (shard.vocab_size, shard.head_size) == (full.vocab_size, full.head_size)
    vocab_start, vocab_rows = _vocab_rows(config.vocab_size, rank)
    embed = shard.model.embed_tokens.weight
    assert embed.shape == (-(-config.vocab_size // TP), hidden)
    assert torch.equal(
        embed[:vocab_rows], full.model.embed_tokens.weight[vocab_start:][:vocab_rows]
    )
    assert not embed[vocab_rows:].any(), "padding rows must be zero"
    for mine, whole in zip(shard.model.layers, full.model.layers, strict=True):
        qkv, full_qkv = mine.self_attn.qkv_proj.weight, whole.self_attn.qkv_proj.weight
        assert qkv.shape == (q_size + 2 * kv_size, hidden)
        full_q_size = heads * head_size
        full_kv_size = config.num_key_value_heads * head_size
        k_start = full_q_size + first_kv * head_size
        v_start = k_start + full_kv_size
        assert torch.equal(qkv[:q_size], full_qkv[rank * q_size :][:q_size])
        assert torch.equal(qkv[q_size:][:kv_size], full_qkv[k_start:][:kv_size])
        assert torch.equal(qkv[q_size + kv_size :], full_qkv[v_start:][:kv_size])
        o_proj = mine.self_attn.o_proj.weight
        assert o_proj.shape == (hidden, q_size)
        assert torch.equal(o_proj, whole.self_attn.o_proj.weight[:, rank * q_size :][:, :q_size])
        assert mine.mlp.gate_up_proj.weight.shape == (2 * inter, hidden)
        assert mine.mlp.down_proj.weight.shape == (hidden, inter)


# ---------------------------------------------------------------- the per-rank check


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def _check_logits_match(shard: Any, full: Any, comm: Communicator) -> None:
    """Prefill two sequences, then decode both twice: TP logits equal the whole model's and
    are bitwise the same on every rank."""
    ops = ReferenceAttentionOps()
    ours, reference = PagedRunner(shard, ops, seed=5), PagedRunner(full, ops, seed=5)
    vocab = full.vocab_size
    steps = [{"a": _prompt(13, vocab, 1), "b": _prompt(21, vocab, 2)}]
    steps += [{"a": [7 + i], "b": [vocab - 1 - i]} for i in range(2)]  # incl. the last id
    for chunks in steps:
        got, expected = ours.step(chunks), reference.step(chunks)
        for seq in chunks:
            assert got[seq].shape == (len(chunks[seq]), vocab)
            torch.testing.assert_close(got[seq], expected[seq], atol=1e-5, rtol=0)
            everyone = comm.all_gather(got[seq].unsqueeze(0))
            assert all(torch.equal(other, got[seq]) for other in everyone)


def check_models_on_rank(model_dirs: dict[str, Path], comm: Communicator) -> None:
    """Per model: read only the shard, hold the right rows, and compute the same logits."""
    tp = TPGroup.from_communicator(comm)
    for name, model_dir in model_dirs.items():
        try:
            config = AutoConfig.from_pretrained(model_dir)
            full = load_model(model_dir, config, torch.float32, CPU, ReferenceAttentionOps())
            shard, reads = _load_recording_reads(model_dir, config, tp)
            checkpoint = _checkpoint_shapes(model_dir)
            assert sorted(read[0] for read in reads) == sorted(checkpoint), "read each once"
            for tensor_name, shape in reads:
                expected = _expected_read(tensor_name, checkpoint[tensor_name], config, tp.rank)
                assert shape == expected, (tensor_name, shape, expected)
            _check_shard_shapes_and_contents(shard, full, config, tp.rank)
            _check_logits_match(shard, full, comm)
        except AssertionError as error:
            raise AssertionError(f"model {name}, rank {tp.rank}: {error}") from error


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Full shape of every tensor of the (single-file) checkpoint, from its header."""
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


def test_tp2_matches_single_process_and_reads_only_its_shard(model_dirs):
    run_ranks(TP, functools.partial(check_models_on_rank, model_dirs), timeout_s=120)


# ---------------------------------------------------------------- in-process checks


def _fake_communicator(rank: int, size: int) -> Any:
    """Enough of a communicator to build a shard; any collective would fail loudly."""
    return SimpleNamespace(rank=rank, world_size=size)


@pytest.mark.parametrize(
    ("overrides", "size", "message"),
    [
        ({}, 3, "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16},
            2,
            "num_key_value_heads=3 is not divisible by tensor_parallel_size=2",
        ),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16},
            3,
            "tensor_parallel_size=3 is not a multiple of num_key_value_heads=2",
        ),
        (
            {"num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 16},
            3,
            "intermediate_size=128 is not divisible by tensor_parallel_size=3",
        ),
    ],
)
def test_unsplittable_models_are_refused_before_loading(
    overrides, size, message, tiny_model_dir, tmp_path
):
    config = tiny_hf_config("llama")
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ConfigError, match=message):
        check_tensor_parallel(config, size)
    tp = TPGroup(1, size, _fake_communicator(1, size))
    with pytest.raises(ConfigError, match=message):  # before any weight is read
        load_model(tmp_path, config, torch.float32, CPU, ReferenceAttentionOps(), tp=tp)


def test_divisible_models_pass_the_check():
    for name, size in (("llama", 2), ("llama", 4), ("qwen3", 4)):
        check_tensor_parallel(tiny_hf_config(name), size)  # 2 KV heads: split, or replicated


def test_tp_group_is_validated():
    single = TPGroup.single()
    assert (single.rank, single.size, single.communicator, single.is_parallel) == (
        0,
        1,
        None,
        False,
    )
    with pytest.raises(ConfigError, match="needs a communicator"):
        TPGroup(0, 2, None)
    with pytest.raises(ConfigError, match="communicator is rank 1 of 2"):
        TPGroup(0, 2, _fake_communicator(1, 2))
    for rank, size in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ConfigError, match="invalid tensor-parallel rank"):
            TPGroup(rank, size, _fake_communicator(rank, size))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shard_ranges_tile_the_whole(size):
    groups = [TPGroup(r, size, _fake_communicator(r, size)) for r in range(size)]
    assert [g.shard_range(12) for g in groups] == [
        (r * 12 // size, 12 // size) for r in range(size)
    ]
    for total in (1, 7, 12, 251):
        ranges = [g.padded_shard_range(total) for g in groups]
        padded = {p for _, _, p in ranges}
        assert padded == {-(-total // size)}
        covered = [i for start, length, _ in ranges for i in range(start, start + length)]
        assert covered == list(range(total))
    if size > 1:
        with pytest.raises(
            ConfigError, match=f"x=13 is not divisible by tensor_parallel_size={size}"
        ):
            groups[0].shard_range(13, "x")
