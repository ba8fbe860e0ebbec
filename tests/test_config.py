"""Config: frozen dataclasses, flat keys, YAML files, CLI flags overriding YAML."""

from __future__ import annotations

import dataclasses

import pytest

from platform_core.cli.main import build_parser
from platform_core.config import EngineConfig, load_yaml_config
from platform_core.entrypoints.engine_args import engine_config_from_args
from platform_core.errors import ConfigError


def test_flat_keys_route_to_sections_and_configs_are_frozen():
    config = EngineConfig.from_flat(block_size=32, max_num_seqs=4, dtype="bfloat16", backend="cpu")
    assert config.cache.block_size == 32
    assert config.scheduler.max_num_seqs == 4
    assert config.model.dtype == "bfloat16"
    assert config.backend == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 8
    assert EngineConfig.from_flat(**config.to_flat()) == config


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="unknown config key 'blok_size'"):
        EngineConfig.from_flat(blok_size=32)


@pytest.mark.parametrize(
    "key,value,field",
    [
        ("block_size", 0, "block_size"),
        ("dtype", "int4", "dtype"),
        ("memory_utilization", 1.5, "memory_utilization"),
        ("max_num_seqs", 0, "max_num_seqs"),
    ],
)
def test_invalid_values_name_the_field(key, value, field):
    with pytest.raises(ConfigError, match=field):
        EngineConfig.from_flat(**{key: value})


def test_yaml_unknown_key_is_named(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("block-size: 32\nmax_num_sqs: 3\n")
    with pytest.raises(ConfigError, match="max_num_sqs"):
        load_yaml_config(path)


def test_cli_flags_override_yaml(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("block_size: 32\nmax_num_seqs: 3\nenable_prefix_caching: false\n")
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--config", str(path), "--max-num-seqs", "7"]
    )
    config = engine_config_from_args(args)
    assert config.cache.block_size == 32  # from the file
    assert config.scheduler.max_num_seqs == 7  # the flag wins
    assert config.cache.enable_prefix_caching is False
    assert config.scheduler.max_num_batched_tokens == 2048  # built-in default
