"""KV connectors are plugins: found through entry points (the built-ins too), versioned, and a
third-party one (the dummy package's, a transport of its own) pairs engines like a built-in."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

from platform_core import LLM
from platform_core.errors import ConfigError
from platform_core.kv_connector_api import (
    KV_CONNECTOR_API_VERSION,
    KVConnectorInfo,
    KVConnectorRegistry,
    KVTransferConfig,
    hookimpl,
)
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


def test_builtin_and_third_party_connectors_are_listed():
    rows = {info.name: info for info, _ in KVConnectorRegistry().infos()}
    assert {"tcp", "shm", "loopback", "faults"} <= set(rows)
    assert rows["tcp"].package == "platform-core"
    assert rows["dummy-pipe"].package == "platform-core-dummy-backend"
    listing = subprocess.run(
        [sys.executable, "-m", "platform_core.cli.main", "kv-connectors"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "dummy-pipe" in listing and "tcp" in listing


def test_a_third_party_connector_pairs_engines(tiny_model_dir):
    model = tiny_model_dir("llama")
    producer = connector_llm(model, "kv_producer", connector="dummy-pipe")
    consumer = connector_llm(model, "kv_consumer", connector="dummy-pipe", backend="template")
    prompt = prompt_of(45, start=5)
    output = decode(consumer, "d", prompt, GREEDY, prefill(producer, "p", prompt))
    reference = LLM(str(model), backend="cpu", **COMMON)
    expected = reference.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert tokens(output) == tokens(expected)
    assert consumer.engine.stats()["kv_transfer_blocks_received"] == 3  # 44 tokens
    settle(producer)
    settle(consumer)
    for llm in (producer, consumer):
        llm.engine.shutdown()


class _FutureConnector:
    """A plugin built for a newer connector API than this core's."""

    @hookimpl
    def platform_core_kv_connector_info(self):
        major, minor = KV_CONNECTOR_API_VERSION
        return [KVConnectorInfo("future", "future-pkg", "1.0", (major, minor + 1))]


def test_a_connector_for_a_newer_api_is_refused_with_the_side_to_update():
    registry = KVConnectorRegistry(eps=[])
    registry.register(_FutureConnector(), name="future")
    with pytest.raises(ConfigError, match="update the side that is older"):
        registry.create_scheduler(KVTransferConfig("future"), 16)


def test_a_broken_connector_plugin_is_reported_not_fatal():
    broken = EntryPoint("broken", "no_such_module_for_kv:plugin", "platform_core.kv_connectors")
    registry = KVConnectorRegistry(eps=[broken])
    assert "no_such_module_for_kv" in registry.broken["broken"]
    with pytest.raises(ConfigError, match=r"unknown KV connector 'tcp'.*failed"):
        registry.create_scheduler(KVTransferConfig("tcp"), 16)


def test_kv_transfer_config_parsing():
    config = KVTransferConfig.parse('{"kv_connector": "tcp", "kv_role": "kv_consumer"}')
    assert config.is_consumer and not config.is_producer
    for bad, message in (
        ('{"kv_connector": "tcp", "kv_rol": "x"}', "unknown kv_transfer_config key"),
        ('{"kv_connector": "tcp", "kv_role": "both"}', "kv_role must be one of"),
        ("not json", "not valid JSON"),
        ('["tcp"]', "must be a mapping"),
    ):
        with pytest.raises(ConfigError, match=message):
            KVTransferConfig.parse(bad)


def test_kv_transfer_config_from_yaml_and_flags(tmp_path):
    import argparse

    from platform_core.entrypoints.engine_args import add_engine_args, engine_config_from_args

    path = tmp_path / "engine.yaml"
    path.write_text(
        "kv_transfer_config:\n  kv_connector: tcp\n  kv_role: kv_producer\n  kv_port: 14600\n"
    )
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    from_yaml = engine_config_from_args(parser.parse_args(["--config", str(path)]))
    assert from_yaml.kv_transfer.kv_transfer_config == KVTransferConfig(
        "tcp", kv_role="kv_producer", kv_port=14600
    )
    flag = '{"kv_connector": "shm", "kv_role": "kv_consumer"}'
    args = parser.parse_args(["--config", str(path), "--kv-transfer-config", flag])
    assert engine_config_from_args(args).kv_transfer.kv_transfer_config.kv_connector == "shm"
