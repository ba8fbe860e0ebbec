"""Start-up: resolve the model, choose the backend, load weights, size the KV cache.

Kept apart from the engine loop so the loop module reads as the loop. Every decision made here is
logged once, so "why is it running like this" is answered by the start-up log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from platform_core.config import EngineConfig
from platform_core.errors import ConfigError, UnsupportedByBackendError
from platform_core.plugins.interfaces import Backend
from platform_core.plugins.manager import PluginManager
from platform_core.scheduler.scheduler import Scheduler
from platform_core.spec.proposer import Proposer, build_proposer
from platform_core.worker.model_runner import ModelRunner

logger = logging.getLogger("platform_core.engine")


@dataclass(slots=True)
class EngineSetup:
    """The parts an engine is made of, after start-up decisions."""

    config: EngineConfig
    backend: Backend
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


def apply_backend_adjustments(config: EngineConfig, backend: Backend) -> EngineConfig:
    """Apply and log the config changes the backend asks for."""
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


def build_engine_parts(config: EngineConfig) -> EngineSetup:
    """Run start-up in order and return the assembled parts."""
    from platform_core.models.hf_files import (
        generation_defaults,
        load_generation_config,
        load_hf_config,
        load_tokenizer,
    )
    from platform_core.models.loader import dtype_from_config
    from platform_core.models.resolve import resolve_model_path

    model_dir = resolve_model_path(config.model.model)
    hf_config = load_hf_config(model_dir, config.model.trust_remote_code)
    declared = dtype_from_config(hf_config, config.model.dtype)
    config = config.replace(model=str(model_dir), dtype=str(declared).removeprefix("torch."))

    plugins = PluginManager()
    backend = plugins.create(config)
    config = apply_backend_adjustments(config, backend)
    head_size = head_size_of(hf_config)
    check_capabilities(config, backend, head_size)

    tokenizer = (
        None
        if config.model.skip_tokenizer_init
        else load_tokenizer(config.model.tokenizer or model_dir)
    )
    generation_config = load_generation_config(model_dir)
    eos_token_ids = eos_ids_of(hf_config, generation_config, tokenizer)
    dtype = dtype_from_config(hf_config, config.model.dtype)
    runner = ModelRunner(config, backend, model_dir, hf_config, dtype, eos_token_ids)

    max_model_len = _max_model_len(config, hf_config)
    block_size = config.cache.block_size
    blocks_per_seq = -(-max_model_len // block_size)
    proposer = build_proposer(config, backend, dtype, runner.model.vocab_size)
    plan = runner.plan_kv_cache(
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
    runner.allocate_kv_cache(plan.num_blocks)
    if proposer is not None and proposer.bytes_per_block:
        proposer.allocate(plan.num_blocks)
    scheduler = Scheduler(config.scheduler, config.cache, plan.num_blocks)

    num_params = sum(p.numel() for p in runner.model.parameters())
    logger.info(
        "loaded %s (%s, %.1fM params, %s) on backend %s; KV cache %d blocks x %d tokens "
        "(%.1f MiB, %s); max_model_len %d",
        model_dir,
        getattr(hf_config, "architectures", ["?"])[0],
        num_params / 1e6,
        config.model.dtype,
        backend.name,
        plan.num_blocks,
        block_size,
        plan.num_blocks * plan.bytes_per_block / 2**20,
        plan.source,
        max_model_len,
    )
    vocab_size = runner.model.vocab_size
    return EngineSetup(
        config=config,
        backend=backend,
        runner=runner,
        scheduler=scheduler,
        tokenizer=tokenizer,
        model_dir=model_dir,
        hf_config=hf_config,
        max_model_len=max_model_len,
        eos_token_ids=eos_token_ids,
        vocab_size=vocab_size,
        default_sampling=(
            generation_defaults(generation_config)
            if config.model.generation_config == "auto"
            else {}
        ),
        proposer=proposer,
    )


def _max_model_len(config: EngineConfig, hf_config: Any) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    requested = config.model.max_model_len
    if requested is not None and requested > limit:
        raise ConfigError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}"
        )
    return requested or limit
