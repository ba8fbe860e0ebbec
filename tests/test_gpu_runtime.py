"""GPU backends at run time: memory profiling over a caching allocator, CUDA-graph buckets,
padding and replay (logic on CPU), and the checks that need a real NVIDIA GPU."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from platform_core.attention.metadata import AttentionMetadata
from platform_core.attention.reference import reference_paged_attention, reference_write_kv
from platform_core.config import EngineConfig
from platform_core.plugins.accelerator import CachingAllocatorProfiler

cuda_plugin = pytest.importorskip(
    "platform_core_cuda.plugin", reason="pip install -e backends/cuda"
)
buckets = pytest.importorskip("platform_core_cuda.graph_buckets")
graph_runner = pytest.importorskip("platform_core_cuda.graph_runner")

HAS_CUDA = torch.cuda.is_available() and torch.version.cuda is not None
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU and a CUDA build of torch")


# --- memory profiling over a caching allocator ---------------------------------------------


class FakeDeviceModule:
    """Stands in for torch.cuda / torch.xpu: a 16 GiB device whose allocator is scripted."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.allocated = 3 << 30  # weights already loaded
        self.peak = self.allocated

    def synchronize(self, device=None):
        self.calls.append("synchronize")

    def empty_cache(self):
        self.calls.append("empty_cache")

    def memory_allocated(self, device=None):
        return self.allocated

    def reset_peak_memory_stats(self, device=None):
        self.calls.append("reset_peak")
        self.peak = self.allocated

    def max_memory_allocated(self, device=None):
        return self.peak

    def mem_get_info(self, device=None):
        self.calls.append("mem_get_info")
        return (12 << 30, 16 << 30)


def test_caching_allocator_profile_reports_the_forward_peak():
    module = FakeDeviceModule()

    def forward():
        module.calls.append("forward")
        module.peak = module.allocated + (1 << 30)  # 1 GiB of activations at the peak

    profiler = CachingAllocatorProfiler(module, torch.device("cpu"))
    report = profiler.profile(forward, weights_bytes=3 << 30)
    assert module.calls.index("reset_peak") < module.calls.index("forward")
    assert module.calls.index("forward") < module.calls.index("mem_get_info")
    assert (report.total_bytes, report.available_bytes) == (16 << 30, 12 << 30)
    assert (report.peak_bytes, report.weights_bytes) == (1 << 30, 3 << 30)
    # 90% of 16 GiB, minus the 4 GiB in use, minus the 1 GiB peak.
    assert profiler.kv_cache_budget(report, 0.9) == int(16 * 0.9 * 2**30) - (5 << 30)


# --- CUDA graphs: buckets, padding, dispatch ----------------------------------------------


def test_capture_sizes_and_buckets():
    assert buckets.capture_sizes(256)[:6] == (1, 2, 4, 8, 16, 24)
    assert buckets.capture_sizes(256)[-1] == 256 and len(buckets.capture_sizes(256)) == 35
    assert buckets.capture_sizes(5) == (1, 2, 4, 5)
    assert buckets.capture_sizes(1) == (1,)
    assert buckets.capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert buckets.capture_sizes(1000)[-1] == 256
    sizes = buckets.capture_sizes(20)
    assert [buckets.bucket_for(sizes, n) for n in (1, 3, 8, 9, 20, 21)] == [1, 4, 8, 16, 20, None]


def _decode_batch(seq_lens, block_size, gen):
    """A decode step (one new token per sequence) with scattered block tables."""
    width = max(-(-s // block_size) for s in seq_lens)
    tables = torch.randperm(len(seq_lens) * width, generator=gen).view(len(seq_lens), width)
    slots = [
        int(tables[i, (s - 1) // block_size]) * block_size + (s - 1) % block_size
        for i, s in enumerate(seq_lens)
    ]
    n = len(seq_lens)
    metadata = AttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables.int(),
        slot_mapping=torch.tensor(slots),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=list(range(n + 1)),
        seq_lens_cpu=list(seq_lens),
    )
    positions = torch.tensor([s - 1 for s in seq_lens])
    input_ids = torch.randint(0, 100, (n,), generator=gen)
    return input_ids, positions, metadata, len(seq_lens) * width


def test_padded_decode_batch_gives_the_same_attention_and_writes_nothing_extra():
    gen = torch.Generator().manual_seed(0)
    input_ids, positions, metadata, num_blocks = _decode_batch([5, 33, 16], 16, gen)
    buffers = buckets.DecodeBuffers.allocate(
        8, max_blocks_per_seq=4, block_size=16, device=torch.device("cpu")
    )
    # A larger batch first, so the smaller one must reset rows it leaves behind.
    big = _decode_batch([3, 4, 5, 6, 7, 8], 16, gen)
    buffers.fill(big[0], big[1], big[2], size=8)
    buffers.fill(input_ids, positions, metadata, size=4)
    ids, pos, padded = buffers.inputs(4, max_seq_len=64)
    assert ids[:3].tolist() == input_ids.tolist() and ids[3].item() == 0
    assert pos.tolist() == [4, 32, 15, 0]
    assert padded.slot_mapping.tolist() == [*metadata.slot_mapping.tolist(), -1]
    assert padded.seq_lens.tolist() == [5, 33, 16, 1]
    assert padded.block_tables[3].tolist() == [0, 0, 0, 0]

    cache = torch.randn((2, num_blocks, 16, 2, 64), generator=gen)
    key, value = torch.randn((2, 4, 2, 64), generator=gen)
    written, expected_cache = cache.clone(), cache.clone()
    reference_write_kv(key, value, written, padded.slot_mapping)
    reference_write_kv(key[:3], value[:3], expected_cache, metadata.slot_mapping)
    assert torch.equal(written, expected_cache)

    query = torch.randn((4, 4, 64), generator=gen)
    padded_out = reference_paged_attention(query, written, _as_host(padded), 0.125)
    plain_out = reference_paged_attention(query[:3], written, metadata, 0.125)
    assert torch.equal(padded_out[:3], plain_out)
    assert torch.isfinite(padded_out[3]).all()


def _as_host(metadata: AttentionMetadata) -> AttentionMetadata:
    """The reference reads host lengths; graphs keep only device ones up to date."""
    metadata.seq_lens_cpu = metadata.seq_lens.tolist()
    return metadata


def test_fill_rejects_batches_a_graph_cannot_take():
    gen = torch.Generator().manual_seed(0)
    input_ids, positions, metadata, _ = _decode_batch([5, 9, 12], 4, gen)
    buffers = buckets.DecodeBuffers.allocate(4, 2, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="block table width 3 exceeds the captured 2"):
        buffers.fill(input_ids, positions, metadata, size=4)
    with pytest.raises(ValueError, match="decode-only batch of at most 2"):
        buffers.fill(input_ids, positions, metadata, size=2)


class ReplayingGraph:
    """A stand-in for a captured CUDA graph: replay re-runs the forward on the static inputs."""

    def __init__(self, forward, out):
        self.forward, self.out = forward, out
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.forward())


def test_graph_runner_replays_decode_batches_and_runs_the_rest_eagerly():
    eager_calls = []

    def model(input_ids, positions, kv_caches, metadata):
        eager_calls.append(metadata.num_tokens)
        return (input_ids * 1000 + positions + metadata.seq_lens[: len(input_ids)]).float()

    kv_caches = [torch.zeros(1)]
    attention = SimpleNamespace(num_splits=None, params=None)
    runner = graph_runner.CudaGraphRunner(
        model, kv_caches, attention, (1, 2, 4), 64, 16, 2, torch.device("cpu")
    )
    ids4, pos4, meta4 = runner.buffers.inputs(4, 64)
    graph = ReplayingGraph(lambda: model(ids4, pos4, kv_caches, meta4), torch.zeros(4))
    runner.graphs[4] = (graph, graph.out)
    eager_calls.clear()

    gen = torch.Generator().manual_seed(0)
    input_ids, positions, metadata, _ = _decode_batch([5, 33, 16], 16, gen)
    out = runner(input_ids, positions, kv_caches, metadata)
    assert graph.replays == 1 and eager_calls == [4]  # the replay's own forward, padded to 4
    assert out.tolist() == model(input_ids, positions, kv_caches, metadata).tolist()
    eager_calls.clear()
    runner(input_ids, positions, [torch.zeros(1)], metadata)  # other caches (profiling run)
    small = _decode_batch([7, 8], 16, gen)
    runner(small[0], small[1], kv_caches, small[2])  # size 2 was never captured
    assert graph.replays == 1 and eager_calls == [3, 2]


# --- on a real NVIDIA GPU ------------------------------------------------------------------


@pytest.mark.gpu
@cuda_only
def test_cuda_probe_on_a_gpu_machine_creates_no_context():
    code = (
        "import torch; from platform_core_cuda.plugin import platform_core_backend_info as p; "
        "i = p(); print(i.available, torch.cuda.is_initialized(), i.reason)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    available, initialized, _ = out.stdout.split(" ", 2)
    assert (available, initialized) == ("True", "False"), out.stdout


def _head64_model_dir(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


@pytest.mark.gpu
@cuda_only
def test_cuda_greedy_tokens_with_and_without_graphs_match_the_cpu_backend(tmp_path):
    from platform_core import LLM, SamplingParams

    model_dir = str(_head64_model_dir(tmp_path))
    prompts = [{"prompt_token_ids": [1, 5, 9, 33, 7] * k} for k in (1, 3, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for backend, enforce_eager in (("cpu", False), ("cuda", True), ("cuda", False)):
        llm = LLM(
            model_dir,
            dtype="float32",
            backend=backend,
            skip_tokenizer_init=True,
            kv_cache_memory_bytes=64 << 20,
            max_num_seqs=8,
            enforce_eager=enforce_eager,
        )
        key = f"{backend}{'-eager' if enforce_eager else ''}"
        tokens[key] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if key == "cuda":  # decode steps of 3 sequences replayed in the size-4 graph
            runner = llm.engine.runner.graph_runner
            assert isinstance(runner, graph_runner.CudaGraphRunner)
            assert sorted(runner.graphs) == [1, 2, 4, 8] and runner.replays >= 20
    assert tokens["cuda-eager"] == tokens["cpu"]
    assert tokens["cuda"] == tokens["cpu"]


@pytest.mark.gpu
@cuda_only
def test_cuda_memory_profile_sees_the_forward_peak():
    backend = cuda_plugin.platform_core_create_backend(name="cuda", config=EngineConfig())
    report = backend.memory.profile(
        lambda: torch.empty(256 << 20, dtype=torch.uint8, device=backend.device), 0
    )
    assert report.peak_bytes >= 256 << 20
    assert 0 < report.available_bytes <= report.total_bytes


@pytest.mark.gpu
@cuda_only
def test_cuda_graph_replay_matches_eager(tmp_path):
    from transformers import AutoConfig

    from platform_core.models.loader import load_model

    backend = cuda_plugin.platform_core_create_backend(name="cuda", config=EngineConfig())
    model_dir = _head64_model_dir(tmp_path)
    model = load_model(
        model_dir,
        AutoConfig.from_pretrained(model_dir),
        torch.float16,
        backend.device,
        backend.attention,
    )
    shape = backend.attention.kv_cache_shape(64, 16, 2, 64)
    kv_caches = [torch.randn(shape, dtype=torch.float16, device=backend.device) for _ in range(2)]
    config = EngineConfig.from_flat(max_num_seqs=8, block_size=16)
    runner = backend.graph_runner(model, kv_caches, config, max_model_len=512)
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    gen = torch.Generator().manual_seed(0)
    input_ids, positions, metadata, _ = _decode_batch([5, 100, 37], 16, gen)
    moved = AttentionMetadata(
        **{
            f: getattr(metadata, f).cuda()
            if isinstance(getattr(metadata, f), torch.Tensor)
            else getattr(metadata, f)
            for f in AttentionMetadata.__slots__
        }
    )
    with torch.inference_mode():
        replayed = runner(input_ids.cuda(), positions.cuda(), kv_caches, moved).clone()
        eager = model(input_ids.cuda(), positions.cuda(), kv_caches, moved)
    torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=2e-2)
