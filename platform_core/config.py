"""Engine configuration: frozen dataclasses validated on construction, loadable from YAML.

Every knob of the engine lives in one of the section dataclasses below. ``EngineConfig.from_flat``
accepts the flat keyword style used by ``LLM(...)``, the CLI and YAML files, routes each key to its
section, and rejects an unknown key with a message that names it and lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from platform_core.errors import ConfigError

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# "gguf": layers keep a quantized GGUF's blocks; "int8" / "int4" / "fp8": 16/32-bit weights
# quantized at load time (Q8_0 / Q4_1 blocks, FP8 e4m3 rows); "none": every weight 16/32-bit.
QUANTIZATIONS = ("gguf", "int8", "int4", "fp8", "none")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to load and how.

    ``quantization`` None (the default) keeps a quantized GGUF's layers quantized unless a
    ``dtype`` other than ``auto`` was asked for; ``"gguf"`` requires that, ``"int8"``, ``"int4"``
    and ``"fp8"`` quantize 16/32-bit weights at load time, ``"none"`` dequantizes.
    """

    model: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    generation_config: str = "auto"
    trust_remote_code: bool = False
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not supported; valid values: {_DTYPES}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                f"quantization={self.quantization!r} is not supported; valid values: "
                f"{QUANTIZATIONS} (or None: automatic)"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.generation_config not in ("auto", "none"):
            raise ConfigError(
                f"generation_config must be 'auto' or 'none', got {self.generation_config!r}"
            )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV-cache sizing and prefix caching.

    ``block_size`` of ``None`` takes the backend's preferred size
    (``Capabilities.preferred_block_size``), resolved when the engine starts.
    """

    block_size: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ConfigError(
                f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}"
            )
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ConfigError(
                f"memory_utilization must be in (0, 1], got {self.memory_utilization}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}"
            )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous-batching limits, the per-step token budget, and the waiting-queue bound.

    ``max_waiting_requests`` bounds the queue of requests not yet running (``None``: unbounded);
    beyond it new requests are refused with ``QueueFullError`` (HTTP 503 with Retry-After).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_waiting_requests: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


_EXECUTORS = ("auto", "uni", "mp", "ray")
WORKER_START_METHODS = ("auto", "fork", "spawn")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Distributed layout: tensor-parallel ranks, how they run, and engine replicas.

    ``distributed_executor_backend``: ``"uni"`` (one process), ``"mp"`` (worker processes on this
    machine), ``"ray"`` (Ray actors in a placement group), ``"auto"`` (``uni`` for one rank, else
    ``mp``). ``ray_address`` joins an existing cluster (``None`` starts a local one).
    ``worker_start_method`` is how ``mp`` starts its workers: ``"fork"``, ``"spawn"``, or
    ``"auto"`` (``$PLATFORM_CORE_WORKER_START`` if set, else fork where it is safe; see
    ``platform_core.distributed.start_method``).
    ``data_parallel_size`` replicas serve behind one server, routed ``least-loaded`` or by
    ``prefix`` affinity.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "auto"
    ray_address: str | None = None
    worker_timeout_s: float = 60.0
    worker_start_method: str = "auto"
    data_parallel_routing: str = "least-loaded"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.distributed_executor_backend not in _EXECUTORS:
            raise ConfigError(
                f"distributed_executor_backend must be one of {_EXECUTORS}, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.data_parallel_routing not in ("least-loaded", "prefix"):
            raise ConfigError(
                "data_parallel_routing must be 'least-loaded' or 'prefix', "
                f"got {self.data_parallel_routing!r}"
            )
        if self.worker_timeout_s <= 0:
            raise ConfigError(f"worker_timeout_s must be > 0, got {self.worker_timeout_s}")
        if self.worker_start_method not in WORKER_START_METHODS:
            raise ConfigError(
                f"worker_start_method must be one of {WORKER_START_METHODS}, "
                f"got {self.worker_start_method!r}"
            )

    @property
    def executor(self) -> str:
        """The executor kind after resolving ``"auto"``."""
        if self.distributed_executor_backend != "auto":
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"


_SPECULATIVE_METHODS = (None, "ngram", "draft")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: propose ``num_speculative_tokens`` per step, verify in one pass.

    Speculation pays when decode is latency-bound; with ``speculative_disable_by_batch_size``
    set, no drafts are proposed in steps where at least that many requests are decoding.
    """

    speculative_method: str | None = None
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None
    speculative_disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.speculative_method not in _SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_method must be one of {_SPECULATIVE_METHODS}, "
                f"got {self.speculative_method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )
        if (
            self.speculative_disable_by_batch_size is not None
            and self.speculative_disable_by_batch_size < 1
        ):
            raise ConfigError(
                "speculative_disable_by_batch_size must be >= 1, "
                f"got {self.speculative_disable_by_batch_size}"
            )
        if self.speculative_method == "draft" and not self.draft_model:
            raise ConfigError("speculative_method='draft' needs draft_model (a model path)")

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig:
    """Constrained decoding, tool calls and reasoning output.

    ``structured_outputs_backend`` picks the grammar engine: ``xgrammar``, ``guidance``
    (llguidance), or ``auto``: xgrammar, falling back to llguidance for a constraint xgrammar
    cannot compile. ``reasoning_parser`` names how the model marks its reasoning
    (``deepseek_r1``, ``qwen3``, or a plugin's): the server returns it as ``reasoning_content``
    and a constraint applies only once the reasoning ended. ``tool_call_parser`` names the tool
    call format the server parses (``hermes``, ``llama3_json``, ``pythonic``, or a plugin's);
    ``enable_auto_tool_choice`` lets the model decide to call tools (``tool_choice: auto``).
    """

    structured_outputs_backend: str = "auto"
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ConfigError(
                f"structured_outputs_backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, "
                f"got {self.structured_outputs_backend!r}"
            )
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("enable_auto_tool_choice needs tool_call_parser (the call format)")


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Serving LoRA adapters over the base model.

    With ``enable_lora`` each layer holds ``max_loras`` adapter slots of rank up to
    ``max_lora_rank`` (lower ranks are zero-padded), so at most ``max_loras`` different adapters
    run in one step; ``max_cpu_loras`` (default: ``max_loras``) adapters stay loaded in host
    memory, least recently used evicted first, and others are read from disk on demand.
    """

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ConfigError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def cpu_capacity(self) -> int:
        """How many adapters host memory keeps loaded."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """A KV connector: this instance hands prompts' KV blocks to others or takes them (P/D
    disaggregation). Key names follow vLLM's ``--kv-transfer-config``.

    ``kv_connector`` names a connector plugin (``platform-core kv-connectors`` lists them);
    ``kv_role``: ``kv_producer`` (a prefill instance: holds finished prompts' blocks for a
    peer), ``kv_consumer`` (a decode instance: loads them), ``kv_both``. ``kv_ip``/``kv_port``
    is where a producer's connector listens for peers (its data side); peers learn it through
    the ``kv_transfer_params`` of each prefill's response (the control side), where
    ``kv_connector_extra_config["advertise_host"]`` may replace ``kv_ip`` (a listener on
    ``0.0.0.0``). ``engine_id`` names this instance to peers (default: a random id).
    ``kv_hold_timeout_s``: how long a producer keeps a finished prompt's blocks for a consumer
    that never comes.
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    engine_id: str | None = None
    kv_hold_timeout_s: float = 120.0
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.kv_connector:
            raise ConfigError("kv_transfer_config needs kv_connector (a connector's name)")
        if self.kv_role not in KV_ROLES:
            raise ConfigError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if not 0 <= self.kv_port < 65536:
            raise ConfigError(f"kv_port must be in [0, 65536), got {self.kv_port}")
        if self.kv_hold_timeout_s <= 0:
            raise ConfigError(f"kv_hold_timeout_s must be > 0, got {self.kv_hold_timeout_s}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError("kv_connector_extra_config must be a mapping")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: KVTransferConfig | dict[str, Any] | str) -> KVTransferConfig:
        """From a mapping or its JSON text; unknown keys raise ``ConfigError`` naming them."""
        if isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"kv_transfer_config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ConfigError(f"kv_transfer_config must be a mapping, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv_transfer_config key(s) {unknown}; valid keys: {sorted(known)}"
            )
        return cls(**value)


@dataclass(frozen=True, slots=True)
class KVTransferSection:
    """The KV connector, if any (``kv_transfer_config``: a mapping or its JSON text)."""

    kv_transfer_config: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        if self.kv_transfer_config is not None:
            parsed = KVTransferConfig.parse(self.kv_transfer_config)
            object.__setattr__(self, "kv_transfer_config", parsed)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """All sections together, plus the backend choice."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    kv_transfer: KVTransferSection = field(default_factory=KVTransferSection)
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_transfer.kv_transfer_config is not None:
            self._check_kv_connector()

    def _check_kv_connector(self) -> None:
        if self.parallel.tensor_parallel_size > 1:
            raise ConfigError(
                "a KV connector runs with tensor_parallel_size 1 only (each rank would move its "
                "own shard; not supported yet)"
            )
        if self.parallel.data_parallel_size > 1:
            raise ConfigError(
                "a KV connector runs with data_parallel_size 1: start one instance per replica "
                "and list them all behind `platform-core proxy --prefill ... --decode ...`"
            )
        if self.speculative.speculative_method == "draft":
            raise ConfigError(
                "a KV connector cannot run with a draft model: the draft's KV cache is not moved"
            )

    @classmethod
    def from_flat(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keys (``block_size=32, dtype="float32", ...``); unknown keys raise."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        top: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key == "backend":
                top[key] = value
                continue
            section = _KEY_TO_SECTION.get(key)
            if section is None:
                raise ConfigError(f"unknown config key {key!r}; valid keys: {sorted(valid_keys())}")
            sections[section][key] = value
        return cls(**{name: _SECTIONS[name](**values) for name, values in sections.items()}, **top)

    def replace(self, **flat: Any) -> EngineConfig:
        """Return a copy with flat keys changed (same key names as ``from_flat``)."""
        return EngineConfig.from_flat(**{**self.to_flat(), **flat})

    def to_flat(self) -> dict[str, Any]:
        """The inverse of ``from_flat``."""
        flat: dict[str, Any] = {"backend": self.backend}
        for name in _SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return flat


_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "speculative": SpeculativeConfig,
    "structured_outputs": StructuredOutputsConfig,
    "lora": LoRAConfig,
    "kv_transfer": KVTransferSection,
}
_KEY_TO_SECTION = {f.name: name for name, cls in _SECTIONS.items() for f in fields(cls)}


def valid_keys() -> set[str]:
    """All flat configuration keys."""
    return set(_KEY_TO_SECTION) | {"backend"}


def load_yaml_config(path: str | Path) -> dict[str, Any]:
    """Read a flat YAML mapping of config keys; unknown keys raise ``ConfigError`` naming them."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    normalized = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(normalized) - valid_keys())
    if unknown:
        raise ConfigError(
            f"{path}: unknown config key(s) {unknown}; valid keys: {sorted(valid_keys())}"
        )
    return normalized
