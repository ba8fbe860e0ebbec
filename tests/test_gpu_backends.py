"""The cuda, rocm and xpu backends: probing, capabilities, config adjustments, errors, memory
profiling and CUDA-graph bucketing, all without a device; real-device checks are marked ``gpu``.

Probing is tested twice: for real on this machine (no GPU: every GPU backend must report itself
unavailable with a reason and touch no device), and through the pure ``describe`` functions fed
with fabricated environments, which covers the outcomes a CPU box cannot produce.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from platform_core.attention.metadata import AttentionMetadata
from platform_core.attention.reference import reference_paged_attention, reference_write_kv
from platform_core.config import EngineConfig
from platform_core.engine.setup import check_capabilities
from platform_core.errors import BackendError, UnsupportedByBackendError
from platform_core.kernels.device_memory import CachingAllocatorProfiler
from platform_core.plugins.manager import PluginManager

cuda_plugin = pytest.importorskip(
    "platform_core_cuda.plugin", reason="pip install -e backends/cuda"
)
cuda_probe = pytest.importorskip("platform_core_cuda.probe")
buckets = pytest.importorskip("platform_core_cuda.graph_buckets")
graph_runner = pytest.importorskip("platform_core_cuda.graph_runner")
rocm_plugin = pytest.importorskip(
    "platform_core_rocm.plugin", reason="pip install -e backends/rocm"
)
rocm_probe = pytest.importorskip("platform_core_rocm.probe")
xpu_plugin = pytest.importorskip("platform_core_xpu.plugin", reason="pip install -e backends/xpu")
xpu_probe = pytest.importorskip("platform_core_xpu.probe")

HAS_CUDA = torch.cuda.is_available() and torch.version.cuda is not None
HAS_ACCELERATOR = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU and a CUDA build of torch")


# --- probing on this machine -------------------------------------------------------------


@pytest.mark.skipif(HAS_ACCELERATOR, reason="checks the outcome on a machine without a GPU")
def test_gpu_backends_are_listed_unavailable_with_reasons_and_touch_no_device():
    rows = {r.name: r for r in PluginManager().probe()}
    for name, package in (
        ("cuda", "platform-core-cuda"),
        ("rocm", "platform-core-rocm"),
        ("xpu", "platform-core-xpu"),
    ):
        row = rows[name]
        assert row.package == package and row.version == "0.1.0"
        assert not row.available and row.reason
        assert row.capabilities is not None and 64 in row.capabilities.head_sizes
    if torch.version.cuda is None:
        assert "has no CUDA support" in rows["cuda"].reason
    assert not torch.cuda.is_initialized()
    assert PluginManager().choose("auto").name not in rows.keys() & {"cuda", "rocm", "xpu"}


@pytest.mark.skipif(HAS_ACCELERATOR, reason="checks the outcome on a machine without a GPU")
@pytest.mark.parametrize("name", ["cuda", "rocm", "xpu"])
def test_choosing_or_creating_an_unavailable_gpu_backend_names_the_reason(name):
    reason = {r.name: r for r in PluginManager().probe()}[name].reason
    with pytest.raises(BackendError, match=f"backend '{name}' is not available"):
        PluginManager().choose(name)
    plugin = {"cuda": cuda_plugin, "rocm": rocm_plugin, "xpu": xpu_plugin}[name]
    with pytest.raises(BackendError) as error:
        plugin.platform_core_create_backend(name=name, config=EngineConfig())
    assert reason in str(error.value)
    assert plugin.platform_core_create_backend(name="cpu", config=EngineConfig()) is None


# --- cuda: probing outcomes, capabilities, adjustments ------------------------------------


def _cuda_env(**overrides):
    base = dict(
        torch_version="2.13.0+cu130",
        cuda_version="13.0",
        hip_version=None,
        triton_version="3.7.1",
        device_count=2,
        count_source="nvml",
        gpus=(cuda_probe.GpuInfo("NVIDIA A100", (8, 0)),) * 2,
    )
    return cuda_probe.CudaEnvironment(**{**base, **overrides})


def test_cuda_available_row_describes_the_gpus():
    info = cuda_probe.describe(_cuda_env(), "0.1.0", cuda_graphs=True)
    assert info.available and info.priority == 100
    assert info.device == "cuda (2 x NVIDIA A100, sm_80)"
    assert "2 GPU(s) via nvml" in info.reason and "triton 3.7.1" in info.reason
    assert "bfloat16" in info.capabilities.dtypes
    assert info.capabilities.block_sizes == (16, 32, 64)
    assert "cuda_graphs" in info.capabilities.features
    no_graphs = cuda_probe.describe(_cuda_env(), "0.1.0", cuda_graphs=False)
    assert "cuda_graphs" not in no_graphs.capabilities.features


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"cuda_version": None, "hip_version": "7.0"}, "is a ROCm build; the rocm backend"),
        ({"cuda_version": None}, "has no CUDA support (a CPU build)"),
        ({"triton_version": None}, "triton is not installed (pip install triton==3.7.1)"),
        (
            {"device_count": 0, "gpus": (), "problem": "NVMLError_DriverNotLoaded()"},
            "no NVIDIA GPU visible (counted by nvml): NVMLError_DriverNotLoaded()",
        ),
    ],
)
def test_cuda_unavailable_reasons(overrides, expected):
    info = cuda_probe.describe(_cuda_env(**overrides), "0.1.0", cuda_graphs=True)
    assert not info.available
    assert expected in info.reason


def test_cuda_count_without_nvml_is_available_and_warns_if_it_touched_the_driver():
    env = _cuda_env(gpus=(), count_source="torch.cuda.device_count", problem="initialised CUDA")
    info = cuda_probe.describe(env, "0.1.0", cuda_graphs=True)
    assert info.available and info.device == "cuda (2 GPU(s))"
    assert "(warning: initialised CUDA)" in info.reason


def test_pre_ampere_gpus_do_not_declare_bf16_and_bf16_is_adjusted_to_fp16():
    env = _cuda_env(gpus=(cuda_probe.GpuInfo("Tesla T4", (7, 5)),), device_count=1)
    assert cuda_probe.describe(env, "0.1.0", True).capabilities.dtypes == ("float16", "float32")
    config = EngineConfig.from_flat(dtype="bfloat16")
    [change] = cuda_plugin.dtype_adjustments(config, (7, 5))
    assert (change.key, change.value) == ("dtype", "float16")
    assert "sm_75" in change.reason
    assert cuda_plugin.dtype_adjustments(config, (9, 0)) == []
    assert cuda_plugin.dtype_adjustments(EngineConfig.from_flat(dtype="float16"), (7, 5)) == []


def test_capability_errors_name_the_cuda_backend_and_valid_values():
    backend = SimpleNamespace(name="cuda", capabilities=cuda_probe.capabilities_for((), True))
    with pytest.raises(UnsupportedByBackendError, match=r"'cuda' does not support head_size=80"):
        check_capabilities(EngineConfig.from_flat(dtype="float16"), backend, head_size=80)
    with pytest.raises(UnsupportedByBackendError, match=r"block_size=8; valid values: \[16, 32"):
        check_capabilities(
            EngineConfig.from_flat(dtype="float16", block_size=8), backend, head_size=64
        )
    check_capabilities(EngineConfig.from_flat(dtype="bfloat16"), backend, head_size=128)


@pytest.mark.parametrize(
    ("env_value", "expected"),
    [
        (None, [0, 1, 2, 3]),
        ("", []),
        ("2,0", [2, 0]),
        ("1,7,2", [1]),  # the runtime stops at the first invalid entry
        ("GPU-8f3a,3", [None, 3]),
        ("-1", []),
    ],
)
def test_cuda_visible_devices_selection(env_value, expected):
    assert cuda_probe.visible_devices(4, env_value) == expected


class NvmlDriverNotLoaded(Exception):
    pass


def _fake_nvml(fail: bool = False) -> ModuleType:
    """A pynvml stand-in: two GPUs (an H100 and an A10), or a driver that is not loaded."""
    nvml = ModuleType("pynvml")
    gpus = [(b"NVIDIA H100", (9, 0)), ("NVIDIA A10", (8, 6))]
    calls = nvml.calls = []

    def init():
        calls.append("init")
        if fail:
            raise NvmlDriverNotLoaded("Driver Not Loaded")

    nvml.nvmlInit = init
    nvml.nvmlShutdown = lambda: calls.append("shutdown")
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = lambda index: index
    nvml.nvmlDeviceGetName = lambda handle: gpus[handle][0]
    nvml.nvmlDeviceGetCudaComputeCapability = lambda handle: gpus[handle][1]
    return nvml


def test_cuda_detect_counts_through_nvml_honouring_visible_devices(monkeypatch):
    nvml = _fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    env = cuda_probe.detect()
    assert (env.device_count, env.count_source) == (1, "nvml")
    assert env.gpus == (cuda_probe.GpuInfo("NVIDIA A10", (8, 6)),)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cuda_probe.detect().gpus[0] == cuda_probe.GpuInfo("NVIDIA H100", (9, 0))
    assert nvml.calls == ["init", "shutdown"] * 2
    assert not torch.cuda.is_initialized()


def test_cuda_detect_reports_nvml_failures_and_falls_back_without_nvml(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    nvml = _fake_nvml(fail=True)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    env = cuda_probe.detect()
    assert env.device_count == 0 and "Driver Not Loaded" in env.problem
    assert nvml.calls == ["init"]  # nothing to shut down
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    env = cuda_probe.detect()
    assert env.count_source == "torch.cuda.device_count" and env.problem is None
    info = cuda_probe.describe(env, "0.1.0", cuda_graphs=True)
    if not HAS_CUDA:
        assert "no NVIDIA GPU visible (counted by torch.cuda.device_count)" in info.reason


def test_cuda_graphs_flag_and_launch_params(monkeypatch):
    monkeypatch.delenv(cuda_plugin.GRAPHS_ENV, raising=False)
    assert cuda_plugin.graphs_enabled()
    monkeypatch.setenv(cuda_plugin.GRAPHS_ENV, "0")
    assert not cuda_plugin.graphs_enabled()
    params = cuda_plugin.cuda_launch_params(num_sms=132)
    assert params.target_programs == 264
    assert params.launch_options() == {"num_warps": 4, "num_stages": 2}


# --- rocm and xpu ------------------------------------------------------------------------


def _rocm_env(**overrides):
    base = dict(
        torch_version="2.13.0+rocm7.0",
        hip_version="7.0",
        cuda_version=None,
        triton_version="3.7.1",
        device_count=8,
    )
    return rocm_probe.RocmEnvironment(**{**base, **overrides})


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"hip_version": None, "cuda_version": "13.0"}, "is a CUDA build; the cuda backend"),
        ({"hip_version": None}, "has no ROCm support (a CPU build)"),
        ({"triton_version": None}, "brings pytorch-triton-rocm"),
        ({"device_count": 0}, "no AMD GPU visible"),
    ],
)
def test_rocm_unavailable_reasons(overrides, expected):
    info = rocm_probe.describe(_rocm_env(**overrides), "0.1.0")
    assert not info.available and expected in info.reason


def test_rocm_available_row_and_launch_settings():
    info = rocm_probe.describe(_rocm_env(), "0.1.0")
    assert info.available and info.device == "rocm (8 GPU(s))" and "HIP 7.0" in info.reason
    params = rocm_plugin.rocm_launch_params(num_compute_units=304)
    assert params.launch_options() == {"num_warps": 4, "num_stages": 1, "waves_per_eu": 2}
    assert params.block_n == 64 and params.target_programs == 608


def _xpu_env(**overrides):
    base = dict(
        torch_version="2.13.0+xpu",
        xpu_compiled=True,
        triton_version="3.7.0",
        ipex_version=None,
        device_count=1,
    )
    return xpu_probe.XpuEnvironment(**{**base, **overrides})


@pytest.mark.parametrize(
    ("ipex", "triton", "kind", "reason"),
    [
        ("2.13.10+xpu", "3.7.0", "ipex", "2.13.10+xpu matches torch 2.13.0+xpu"),
        ("2.8.10+xpu", "3.7.0", "triton", "2.8.10+xpu does not match torch 2.13.0+xpu"),
        (None, "3.7.0", "triton", "intel-extension-for-pytorch is not installed; using the"),
        ("2.13.10+xpu", None, "ipex", "matches"),
        (None, None, None, "pytorch-triton-xpu) is missing"),
    ],
)
def test_xpu_attention_choice(ipex, triton, kind, reason):
    choice = xpu_probe.choose_attention(_xpu_env(ipex_version=ipex, triton_version=triton))
    assert choice.kind == kind and reason in choice.reason


def test_xpu_rows_and_the_logged_triton_choice(caplog):
    ok = xpu_probe.describe(_xpu_env(), "0.1.0")
    assert ok.available and ok.priority == 90 and "attention: triton" in ok.reason
    none = xpu_probe.describe(_xpu_env(triton_version=None), "0.1.0")
    assert not none.available and "no paged attention available" in none.reason
    cpu = xpu_probe.describe(_xpu_env(xpu_compiled=False, device_count=0), "0.1.0")
    assert "has no XPU support" in cpu.reason
    choice = xpu_probe.choose_attention(_xpu_env(ipex_version="2.8.0"))
    with caplog.at_level(logging.INFO, logger="platform_core_xpu"):
        ops = xpu_plugin.build_attention(choice, num_xe_cores=0)
    assert type(ops).__name__ == "TritonAttentionOps" and ops.params.target_programs == 0
    assert "XPU attention: Triton kernels (intel-extension-for-pytorch 2.8.0 does not" in (
        caplog.text
    )
    with pytest.raises(BackendError, match="no paged attention"):
        xpu_plugin.build_attention(xpu_probe.AttentionChoice(None, "nothing"), 0)


def test_backends_name_their_process_group_backend():
    assert cuda_plugin.CudaBackend.process_group_backend == "nccl"
    assert rocm_plugin.RocmBackend.process_group_backend == "nccl"  # RCCL behind the name
    assert xpu_plugin.XpuBackend.process_group_backend == "xccl"


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
def test_cuda_greedy_tokens_match_the_cpu_backend(tmp_path):
    from platform_core import LLM, SamplingParams

    model_dir = str(_head64_model_dir(tmp_path))
    prompts = [{"prompt_token_ids": [1, 5, 9, 33, 7] * k} for k in (1, 3, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for backend in ("cpu", "cuda"):
        llm = LLM(
            model_dir,
            dtype="float32",
            backend=backend,
            skip_tokenizer_init=True,
            kv_cache_memory_bytes=64 << 20,
        )
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
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
