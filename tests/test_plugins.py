"""Backend discovery through entry points, probing, choice, API versions and capability checks."""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint

import pytest

from platform_core import LLM, SamplingParams
from platform_core.errors import BackendError, UnsupportedByBackendError
from platform_core.plugins.hookspecs import ENTRY_POINT_GROUP, hookimpl
from platform_core.plugins.interfaces import BackendInfo
from platform_core.plugins.manager import PluginManager


def test_installed_backends_are_discovered_by_entry_point():
    rows = {r.name: r for r in PluginManager().probe()}
    assert rows["cpu"].available and rows["cpu"].package == "platform-core-cpu"
    assert rows["dummy"].available and rows["dummy"].package == "platform-core-dummy-backend"
    assert rows["dummy"].capabilities.dtypes == ("float32",)


def test_auto_picks_highest_priority_and_name_picks_that_one():
    manager = PluginManager()
    assert manager.choose("auto").name == "cpu"
    assert manager.choose("dummy").name == "dummy"


def test_unknown_backend_names_the_alternatives():
    with pytest.raises(BackendError, match=r"unknown backend 'tpu-x'") as info:
        PluginManager().choose("tpu-x")
    available = str(info.value).split("available:")[1]
    assert "'cpu'" in available and "'dummy'" in available


def test_broken_plugin_is_reported_not_fatal(caplog):
    broken = EntryPoint(
        name="broken", value="no_such_module_for_tests.plugin", group=ENTRY_POINT_GROUP
    )
    with caplog.at_level(logging.WARNING, logger="platform_core.plugins"):
        manager = PluginManager(eps=[broken])
    [row] = manager.probe()
    assert row.name == "broken" and not row.available
    assert "failed to import" in row.reason and "no_such_module_for_tests" in row.reason
    assert "broken" in caplog.text
    with pytest.raises(BackendError, match="not available: failed to import"):
        manager.choose("broken")


def _info(name: str, api_version=(1, 0), priority=5) -> BackendInfo:
    return BackendInfo(name, f"pkg-{name}", "9.9", api_version, True, "ok", priority, "nowhere")


class RaisingProbe:
    @hookimpl
    def platform_core_backend_info(self):
        raise RuntimeError("driver exploded")


class FutureApi:
    @hookimpl
    def platform_core_backend_info(self):
        return _info("future", api_version=(2, 0), priority=100)


def test_probe_errors_and_incompatible_api_make_rows_unavailable():
    manager = PluginManager(eps=[])
    manager.register(RaisingProbe(), name="raising")
    manager.register(FutureApi(), name="future")
    rows = {r.name: r for r in manager.probe()}
    assert not rows["raising"].available and "driver exploded" in rows["raising"].reason
    future = rows["future"]
    assert not future.available
    assert "plugin API 2.0" in future.reason and "provides 1.0" in future.reason
    with pytest.raises(BackendError, match="no backend is available"):
        manager.choose("auto")


def test_third_party_backend_runs_end_to_end_with_its_adjustment(tiny_model_dir, caplog):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(3, 40))}]
    with caplog.at_level(logging.INFO, logger="platform_core.engine"):
        dummy = LLM(str(tiny_model_dir("llama")), backend="dummy", dtype="float32")
    assert dummy.engine.backend.name == "dummy"
    assert dummy.engine.config.cache.block_size == 32  # the backend's requested change
    assert "changed block_size: 16 -> 32" in caplog.text
    cpu = LLM(str(tiny_model_dir("llama")), backend="cpu", dtype="float32")
    got = [o.outputs[0].token_ids for o in dummy.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_unsupported_capability_fails_at_start_naming_everything(tiny_model_dir):
    with pytest.raises(UnsupportedByBackendError) as info:
        LLM(str(tiny_model_dir("llama")), backend="dummy", dtype="bfloat16")
    message = str(info.value)
    assert "'dummy'" in message and "dtype='bfloat16'" in message and "['float32']" in message


def test_cpu_backend_maps_float16_to_a_fast_dtype(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float16", kv_cache_memory_bytes=1 << 22)
    assert llm.engine.config.model.dtype in ("bfloat16", "float32")

