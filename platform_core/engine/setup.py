"""Start-up: resolve the model, choose the backend, load weights, size the KV cache.

Kept apart from the engine loop so the loop module reads as the loop. Every decision made here is
logged once, so "why is it running like this" is answered by the start-up log.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from platform_core.config import EngineConfig
from platform_core.errors import ConfigError, UnsupportedByBackendError
from platform_core.executor.base import Executor, ModelSpec
from platform_core.executor.factory import make_executor
from platform_core.kv_transfer.registry import KVConnectorRegistry
from platform_core.plugins.interfaces import Backend
from platform_core.plugins.manager import PluginManager
from platform_core.scheduler.scheduler import Scheduler
from platform_core.speculative.proposer import Proposer, build_proposer
from platform_core.worker.model_runner import KVCachePlan, ModelRunner

logger = logging.getLogger("platform_core.engine")


@dataclass(slots=True)
class EngineSetup:
    """The parts an engine is made of, after start-up decisions."""

    config: EngineConfig
    backend: Backend
    executor: Executor
    runner: ModelRunner
    scheduler: Scheduler
    tokenizer: Any
    model_dir: Path
    hf_config: Any
    max_model_len: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    default_sampling: dict[str, Any]
    proposer: Proposer | None


def apply_auto_dtype(config: EngineConfig, backend: Backend) -> EngineConfig:
    """``dtype="auto"`` on a float32 checkpoint: the backend's choice, when it names one (as
    vLLM's ``auto`` runs float32 checkpoints in 16 bits)."""
    target = backend.capabilities.auto_float32_dtype
    if config.model.dtype != "float32" or target is None:
        return config
    reason = backend.capabilities.auto_dtype_reason
    logger.info(
        "dtype auto: the float32 checkpoint runs in %s on backend %s%s (pass dtype=float32 to "
        "keep float32)",
        target,
        backend.name,
        f": {reason}" if reason else "",
    )
    return config.replace(dtype=target)


def resolve_quantization(
    config: EngineConfig, model_dir: Path, backend: Backend, dtype_was_auto: bool
) -> EngineConfig:
    """``quantization`` None: the checkpoint's own (``"gguf"`` for one with quantized blocks,
    ``"fp8"`` for float8 weights) on a backend with its own ``quantized_linear`` op (for FP8,
    one with a kernel for it: :func:`~platform_core.quantization.formats.has_kernel`), unless a
    dtype was asked for; else ``"none"`` (logged). ``"gguf"`` without blocks is a ConfigError.

    Without its own op a backend would dequantize every weight on every step (the reference
    op): slower than dequantizing once at load, so ``auto`` does that instead.
    """
    from platform_core.models.fp8_checkpoint import stored_fp8
    from platform_core.models.quantized_checkpoint import quantized_formats
    from platform_core.quantization.formats import FP8_E4M3, has_kernel

    asked = config.model.quantization
    stored = "gguf" if quantized_formats(model_dir) else "fp8" if stored_fp8(model_dir) else None
    if asked == "gguf" and stored != "gguf":
        raise ConfigError(
            f"quantization='gguf' needs a quantized GGUF checkpoint; {model_dir} keeps no "
            "quantized tensors"
        )
    if asked is not None or stored is None:
        return config.replace(quantization=asked or "none")
    op = backend.op_overrides().get("quantized_linear")
    if not dtype_was_auto:
        why = f"dtype={config.model.dtype} was asked for"
    elif op is None:
        why = f"backend {backend.name} has no quantized_linear kernel of its own"
    elif stored == "fp8" and not has_kernel(op, FP8_E4M3):
        why = f"backend {backend.name}'s quantized_linear has no kernel for FP8_E4M3"
    else:
        logger.info(
            "quantization %s: the checkpoint's quantized linears compute on their weights as "
            "stored (pass quantization='none' or a dtype to dequantize them)",
            stored,
        )
        return config.replace(quantization=stored)
    logger.info(
        "quantization none: %s, so the checkpoint's quantized tensors run dequantized (pass "
        "quantization='%s' to keep them)",
        why,
        stored,
    )
    return config.replace(quantization="none")


def apply_backend_adjustments(config: EngineConfig, backend: Backend) -> EngineConfig:
    """Fill in the backend's preferred block size when none was set, then apply and log the
    config changes the backend asks for."""
    if config.cache.block_size is None:
        preferred = backend.capabilities.preferred_block_size
        logger.info("block_size %d (backend %s's preferred size)", preferred, backend.name)
        config = config.replace(block_size=preferred)
    for change in backend.adjust_config(config):
        old = config.to_flat().get(change.key)
        logger.info(
            "backend %s changed %s: %r -> %r (%s)",
            backend.name,
            change.key,
            old,
            change.value,
            change.reason,
        )
        config = config.replace(**{change.key: change.value})
    return config


def check_capabilities(config: EngineConfig, backend: Backend, head_size: int) -> None:
    """Fail at start-up, naming backend, capability and valid values, if unsupported."""
    caps = backend.capabilities
    for capability, value, valid in (
        ("dtype", config.model.dtype, caps.dtypes),
        ("head_size", head_size, caps.head_sizes),
        ("block_size", config.cache.block_size, caps.block_sizes),
    ):
        if capability == "block_size" and value is None:
            continue  # unset: the backend's preferred size, filled in at start-up
        if value not in valid:
            raise UnsupportedByBackendError(backend.name, capability, value, list(valid))
    if caps.max_batch is not None and config.scheduler.max_num_seqs > caps.max_batch:
        raise UnsupportedByBackendError(
            backend.name, "max_num_seqs", config.scheduler.max_num_seqs, f"<= {caps.max_batch}"
        )


def head_size_of(hf_config: Any) -> int:
    explicit = getattr(hf_config, "head_dim", None)
    return explicit or hf_config.hidden_size // hf_config.num_attention_heads


def eos_ids_of(hf_config: Any, generation_config: Any, tokenizer: Any) -> frozenset[int]:
    """Every token id that ends a sequence, from config, generation config and tokenizer."""
    ids: set[int] = set()
    for source in (hf_config, generation_config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def load_model_tokenizer(config: EngineConfig, model_dir: Path | None = None) -> Any:
    """The tokenizer an engine for ``config`` uses (``None`` with ``skip_tokenizer_init`` or
    when the model has none), from the tokenizer files alone: no weights are loaded, so a front
    in another process than the engine gets its own copy cheaply."""
    from platform_core.models.hf_files import load_tokenizer
    from platform_core.models.resolve import resolve_model_path

    if config.model.skip_tokenizer_init:
        return None
    return load_tokenizer(
        config.model.tokenizer or model_dir or resolve_model_path(config.model.model)
    )


def build_engine_parts(config: EngineConfig) -> EngineSetup:
    """Run start-up in order and return the assembled parts."""
    from platform_core.models.hf_files import (
        generation_defaults,
        load_generation_config,
        load_hf_config,
    )
    from platform_core.models.loader import dtype_from_config
    from platform_core.models.resolve import resolve_model_path

    model_dir = resolve_model_path(config.model.model)
    hf_config = load_hf_config(model_dir, config.model.trust_remote_code)
    declared = dtype_from_config(hf_config, config.model.dtype)
    auto_dtype = config.model.dtype == "auto"
    config = config.replace(model=str(model_dir), dtype=str(declared).removeprefix("torch."))

    plugins = PluginManager()
    backend = plugins.create(config)
    config = resolve_quantization(config, model_dir, backend, auto_dtype)
    if auto_dtype:
        config = apply_auto_dtype(config, backend)
    config = apply_backend_adjustments(config.replace(backend=backend.name), backend)
    config = resolve_kv_transfer(config)
    head_size = head_size_of(hf_config)
    check_capabilities(config, backend, head_size)

    tokenizer = load_model_tokenizer(config, model_dir)
    generation_config = load_generation_config(model_dir)
    eos_token_ids = eos_ids_of(hf_config, generation_config, tokenizer)
    dtype = dtype_from_config(hf_config, config.model.dtype)
    connector_arguments = kv_connector_arguments(config)  # fails before any worker starts
    executor = make_executor(ModelSpec(config, model_dir, hf_config, dtype, eos_token_ids), backend)
    try:
        max_model_len = _max_model_len(config, hf_config)
        proposer = build_proposer(config, backend, dtype, executor.driver.model.vocab_size)
        num_blocks, max_model_len = _size_kv_cache(config, executor, proposer, max_model_len)
        executor.allocate_kv_cache(num_blocks, max_model_len)
        if proposer is not None and proposer.bytes_per_block:
            proposer.allocate(num_blocks)
    except BaseException:
        executor.shutdown()
        raise
    return EngineSetup(
        config=config,
        backend=backend,
        executor=executor,
        runner=executor.driver,
        scheduler=Scheduler(
            config.scheduler,
            config.cache,
            num_blocks,
            config.lora.max_loras if config.lora.enable_lora else None,
            **connector_arguments,
        ),
        tokenizer=tokenizer,
        model_dir=model_dir,
        hf_config=hf_config,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids,
        vocab_size=executor.driver.model.vocab_size,
        default_sampling=(
            generation_defaults(generation_config)
            if config.model.generation_config == "auto"
            else {}
        ),
        proposer=proposer,
    )


def resolve_kv_transfer(config: EngineConfig) -> EngineConfig:
    """Give this instance an engine id for its KV connector's peers when the user named none
    (``EngineConfig`` checked that the connector fits the rest of the config)."""
    transfer = config.kv_transfer.kv_transfer_config
    if transfer is None:
        return config
    if transfer.engine_id is not None:
        return config
    engine_id = uuid.uuid4().hex
    logger.info("KV connector %s: engine id %s", transfer.kv_connector, engine_id)
    return config.replace(kv_transfer_config=dataclasses.replace(transfer, engine_id=engine_id))


def kv_connector_arguments(config: EngineConfig) -> dict[str, Any]:
    """The scheduler's KV-connector arguments (none without a connector)."""
    transfer = config.kv_transfer.kv_transfer_config
    if transfer is None:
        return {}
    connector = KVConnectorRegistry().create_scheduler(transfer, config.cache.block_size)
    return {"kv_connector": connector, "kv_hold_timeout_s": transfer.kv_hold_timeout_s}


def _size_kv_cache(
    config: EngineConfig, executor: Executor, proposer: Proposer | None, max_model_len: int
) -> tuple[int, int]:
    """Blocks for the KV cache, and ``max_model_len`` lowered if the pool cannot hold it."""
    block_size = config.cache.block_size
    blocks_per_seq = -(-max_model_len // block_size)
    plan = executor.plan_kv_cache(
        config.scheduler.max_num_seqs * blocks_per_seq,
        max_model_len,
        extra_bytes_per_block=proposer.bytes_per_block if proposer else 0,
    )
    if plan.num_blocks < 1:
        raise ConfigError(
            f"no memory is left for the KV cache (budget {plan.budget_bytes} bytes from "
            f"{plan.source}, {plan.bytes_per_block} bytes per block); "
            "set kv_cache_memory_bytes or use a smaller model"
        )
    if plan.num_blocks * block_size < max_model_len:
        logger.warning(
            "KV cache holds %d tokens, fewer than max_model_len=%d; lowering max_model_len",
            plan.num_blocks * block_size,
            max_model_len,
        )
        max_model_len = plan.num_blocks * block_size
    _log_loaded(config, executor, plan, max_model_len)
    return plan.num_blocks, max_model_len


def _log_loaded(
    config: EngineConfig, executor: Executor, plan: KVCachePlan, max_model_len: int
) -> None:
    runner = executor.driver
    memory = plan.memory
    free = (
        ""
        if memory is None
        else f"; {memory.available_bytes / 2**30:.1f} of {memory.total_bytes / 2**30:.1f} GiB "
        f"free, activation peak {memory.peak_bytes / 2**20:.0f} MiB"
    )
    logger.info(
        "loaded %s (%s, %.1fM params, %s%s, %.0f MiB of weights, TP=%d) on backend %s; KV cache "
        "%d blocks x %d tokens = %.1f MiB (%s%s); max_model_len %d",
        config.model.model,
        type(runner.model).__name__,
        runner.parameter_count / 1e6,
        config.model.dtype,
        "" if runner.quantization is None else f", {runner.quantization}",
        runner.weights_bytes / 2**20,
        config.parallel.tensor_parallel_size,
        config.backend,
        plan.num_blocks,
        config.cache.block_size,
        plan.num_blocks * plan.bytes_per_block / 2**20,
        plan.source,
        free,
        max_model_len,
    )


def _max_model_len(config: EngineConfig, hf_config: Any) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    requested = config.model.max_model_len
    if requested is not None and requested > limit:
        raise ConfigError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}"
        )
    return requested or limit
