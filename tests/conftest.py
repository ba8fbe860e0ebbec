"""Shared fixtures: tiny seeded HF models saved as safetensors, and the reference attention ops.

``engine`` is the server tests' engine, in the mode under test (``server_utils.ENGINE_MODE``):
one per model directory, shared by the modules that do not start their own (``shared_engines``);
``probe`` / ``steps`` control its steps wherever it runs (``engine_probe.EngineProbe``).

``tiny_model_dir(name)`` builds (once per session) a small random model with transformers, saves
it with ``save_pretrained`` and returns the directory, so the real loading code runs. Weights are
drawn from a seeded generator (norm weights around 1, biases non-zero) so every parameter
matters. Names are the keys of ``TINY_MODELS``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from platform_core.attention.reference import ReferenceAttentionOps
from platform_core.plugins.interfaces import AttentionOps

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}

# name -> (HF architecture, config overrides on top of _BASE)
TINY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "llama_tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3_rope": (
        "LlamaForCausalLM",
        {
            "num_hidden_layers": 3,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama_bias_linear_rope": (
        "LlamaForCausalLM",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
    ),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", {"num_hidden_layers": 3}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
}

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def tiny_hf_config(name: str) -> Any:
    """The transformers config of tiny model ``name``."""
    from transformers import AutoConfig

    architecture, overrides = TINY_MODELS[name]
    return AutoConfig.for_model(
        _MODEL_TYPES[architecture], architectures=[architecture], **{**_BASE, **overrides}
    )


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Deterministic weights of a useful scale: the same for a given seed on any machine."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.1 * noise)


def build_tiny_model(name: str, seed: int = 0) -> Any:
    """A fresh float32 HF model for ``name`` with seeded weights (eager attention)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_hf_config(name), dtype=torch.float32, attn_implementation="eager"
    )
    _randomize(model, seed)
    return model.eval()


def load_on_cpu(
    model_dir: Path, attention_ops: AttentionOps, dtype: torch.dtype = torch.float32, **kwargs: Any
) -> Any:
    """Our model for the checkpoint in ``model_dir``, on the CPU with ``attention_ops``."""
    from transformers import AutoConfig

    from platform_core.models.loader import load_model

    config = AutoConfig.from_pretrained(model_dir)
    return load_model(model_dir, config, dtype, torch.device("cpu"), attention_ops, **kwargs)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: ``tiny_model_dir("llama")`` -> directory with config.json + model.safetensors."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            path = tmp_path_factory.mktemp(f"tiny-{name}")
            build_tiny_model(name).save_pretrained(path, safe_serialization=True)
            built[name] = path
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_reference_model(tiny_model_dir: Callable[[str], Path]) -> Callable[[str], Any]:
    """Factory: the HF model loaded back from ``tiny_model_dir(name)`` (fp32, eager, eval)."""
    from transformers import AutoModelForCausalLM

    loaded: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in loaded:
            loaded[name] = AutoModelForCausalLM.from_pretrained(
                tiny_model_dir(name), dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return loaded[name]

    return get


@pytest.fixture(scope="session")
def reference_attention_ops() -> AttentionOps:
    """Reference paged-attention ops (pure torch, float32 softmax)."""
    return ReferenceAttentionOps()


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a trained tokenizer and chat template (``tests/text_model.py``)."""
    from text_model import save_text_model

    return save_text_model(tmp_path_factory.mktemp("text-model"))


@pytest.fixture(scope="module")
def model_dir(text_model_dir: Path) -> Path:
    """The model the server tests serve (a module may override it)."""
    return text_model_dir


@pytest.fixture(scope="session")
def shared_engines(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Factory: the server tests' engine on a model directory and its ``EngineProbe``, started
    once per session (an engine core takes seconds to start) and shared by the modules that
    take the default ``engine``; each module hands it back clean (``engine`` checks)."""
    from engine_probe import EngineProbe
    from server_utils import engine_config, start_test_engine

    started: dict[Path, tuple[Any, Any]] = {}

    def get(model_dir: Path) -> tuple[Any, Any]:
        if model_dir not in started:
            probe = EngineProbe(tmp_path_factory.mktemp("probe"))
            started[model_dir] = (start_test_engine(engine_config(model_dir), probe), probe)
        return started[model_dir]

    yield get
    for engine, _ in started.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def probe(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    model_dir: Path,
    shared_engines: Any,
) -> Any:
    """The probe on the module's ``engine``: the shared engine's, or a fresh one for a module
    that defines an ``engine`` of its own (reset by ``steps`` after each test)."""
    from engine_probe import EngineProbe

    if "engine" in vars(request.module):
        return EngineProbe(tmp_path_factory.mktemp("probe"))
    return shared_engines(model_dir)[1]


@pytest.fixture(scope="module")
def engine(model_dir: Path, probe: Any, shared_engines: Any) -> Any:
    """The server tests' engine on ``model_dir``, in the mode under test, with ``probe``: the
    session's shared one, checked clean and its probe reset when the module is done."""
    from server_utils import assert_engine_clean

    engine, _ = shared_engines(model_dir)
    yield engine
    probe.reset()
    assert_engine_clean(engine, probe)


@pytest.fixture(scope="module")
def base_url(engine: Any) -> Any:
    """A live loopback server for ``engine``; yields its base URL."""
    from server_utils import live_server

    with live_server(engine) as url:
        yield url


@pytest.fixture
def steps(engine: Any, probe: Any) -> Any:
    """The ``engine``'s probe: ``delay`` seconds before each step, ``once`` a single stall,
    ``entered`` set in a step (``EngineProbe``); plain steps again after the test."""
    yield probe
    probe.reset()


@pytest.fixture
def no_child_processes_left() -> Any:
    """Fails the test if a child process it started is still running or unreaped after it."""
    from tests.multiproc import new_children

    before = new_children(set())
    yield
    assert not new_children(before), "child processes left running or unreaped"
