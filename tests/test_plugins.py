"""Backend discovery through entry points, probing, choice, API versions and capability checks."""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint
from types import SimpleNamespace

import pytest
import torch

from platform_core import LLM, SamplingParams
from platform_core.cli.main import main as cli_main
from platform_core.config import EngineConfig
from platform_core.errors import BackendError, UnsupportedByBackendError
from platform_core.plugins.hookspecs import (
    ENTRY_POINT_GROUP,
    PLUGIN_API_VERSION,
    HookDeprecationWarning,
    deprecated_hook,
    hookimpl,
    hookspec,
)
from platform_core.plugins.interfaces import BackendInfo
from platform_core.plugins.manager import PluginManager


def test_installed_backends_are_discovered_by_entry_point():
    rows = {r.name: r for r in PluginManager().probe()}
    assert rows["cpu"].available and rows["cpu"].package == "platform-core-cpu"
    assert rows["dummy"].available and rows["dummy"].package == "platform-core-dummy-backend"
    assert rows["dummy"].capabilities.dtypes == ("float32",)
    # The dummy is built for an older minor of the plugin API; it must keep running (below).
    assert rows["dummy"].api_version[0] == PLUGIN_API_VERSION[0]
    assert rows["dummy"].api_version < PLUGIN_API_VERSION


def test_backends_listing_shows_api_versions_and_notes_an_older_minor(capsys):
    assert cli_main(["backends"]) == 0
    out = capsys.readouterr().out
    core = ".".join(map(str, PLUGIN_API_VERSION))
    header, cpu = out.splitlines()[:2]
    assert header.split()[:4] == ["name", "package", "version", "api"]
    assert cpu.split()[:4] == ["cpu", "platform-core-cpu", "0.1.0", core]
    assert (
        f"dummy: the plugin implements plugin API 1.0, older than this platform-core's {core}"
        in out
    )
    assert "cpu: the plugin implements" not in out


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
    core = ".".join(map(str, PLUGIN_API_VERSION))
    assert "plugin API 2.0" in future.reason and f"provides {core}" in future.reason
    with pytest.raises(BackendError, match="no backend is available"):
        manager.choose("auto")


class FixtureBackendPlugin:
    """A plugin of one backend ``name``; its create hook raises ``error`` if given."""

    def __init__(self, name: str, error: Exception | None = None, priority: int = 5) -> None:
        self.name, self.error, self.priority = name, error, priority
        self.created: list[str] = []

    @hookimpl
    def platform_core_backend_info(self) -> BackendInfo:
        return _info(self.name, priority=self.priority)

    @hookimpl
    def platform_core_create_backend(self, name: str, config: EngineConfig):
        self.created.append(name)
        if self.error is not None:
            raise self.error
        return SimpleNamespace(name=self.name) if name == self.name else None


def test_a_raising_create_hook_of_another_plugin_does_not_affect_creating_the_chosen_one():
    good = FixtureBackendPlugin("good")
    bad = FixtureBackendPlugin("bad", RuntimeError("driver exploded"), priority=1)
    manager = PluginManager(eps=[])
    manager.register(good, name="good-plugin")
    manager.register(bad, name="bad-plugin")
    backend = manager.create(EngineConfig.from_flat(backend="good"))
    assert backend.name == "good" and good.created == ["good"]
    assert bad.created == []  # never asked: only the chosen backend's plugin is
    assert manager.create(EngineConfig.from_flat(backend="auto")).name == "good"


def test_a_create_hook_that_raises_is_reported_naming_the_plugin_and_chained(caplog):
    manager = PluginManager(eps=[])
    manager.register(FixtureBackendPlugin("good"), name="good-plugin")
    manager.register(FixtureBackendPlugin("bad", KeyError("no device 3")), name="bad-plugin")
    with (
        caplog.at_level(logging.WARNING, logger="platform_core.plugins"),
        pytest.raises(BackendError) as info,
    ):
        manager.create(EngineConfig.from_flat(backend="bad"))
    message = str(info.value)
    assert "backend plugin 'bad-plugin' failed to create backend 'bad'" in message
    assert "KeyError('no device 3')" in message
    assert isinstance(info.value.__cause__, KeyError)
    assert "bad-plugin" in caplog.text


def test_a_platform_core_error_from_a_create_hook_reaches_the_user_as_raised():
    refusal = BackendError("backend 'picky' is not available: the device went away")
    manager = PluginManager(eps=[])
    manager.register(FixtureBackendPlugin("picky", refusal), name="picky-plugin")
    with pytest.raises(BackendError) as info:
        manager.create(EngineConfig.from_flat(backend="picky"))
    assert info.value is refusal


class DeprecatedHookSpecs:
    """A test-only hookspec deprecated the way a real one would be."""

    @hookspec(warn_on_impl=deprecated_hook("platform_core_old_hook", (1, 1), "use the new one"))
    def platform_core_old_hook(self) -> None:
        """Deprecated since 1.1 (test only)."""


class ImplementsTheDeprecatedHook(FixtureBackendPlugin):
    """A plugin written before the hook was deprecated."""

    @hookimpl
    def platform_core_old_hook(self) -> None:
        """Still implemented by an old plugin."""


def test_registering_a_plugin_that_implements_a_deprecated_hook_warns(recwarn):
    manager = PluginManager(eps=[])
    manager._pm.add_hookspecs(DeprecatedHookSpecs)
    manager.register(FixtureBackendPlugin("current"), name="current")
    assert not [w for w in recwarn if issubclass(w.category, HookDeprecationWarning)]
    with pytest.warns(HookDeprecationWarning) as warned:
        manager.register(ImplementsTheDeprecatedHook("old"), name="old")
    [warning] = warned
    assert str(warning.message) == (
        "hook platform_core_old_hook is deprecated since plugin API 1.1 and is removed in 2.0: "
        "use the new one"
    )
    assert warning.filename == __file__  # points at the plugin's implementation
    assert {r.name for r in manager.probe()} == {"current", "old"}  # it still runs


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


class CountingGraphRunner:
    """A backend's graph runner stand-in: records the calls, then runs the model eagerly."""

    def __init__(self, model, kv_caches):
        self.model, self.kv_caches, self.calls = model, kv_caches, 0

    def __call__(self, input_ids, positions, kv_caches, metadata):
        self.calls += 1
        assert kv_caches is self.kv_caches
        return self.model(input_ids, positions, kv_caches, metadata)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_backend_graph_runner_wraps_every_serving_step(tiny_model_dir, monkeypatch, enforce_eager):
    from platform_core_cpu.plugin import CpuBackend

    made = []

    def graph_runner(self, model, kv_caches, config, max_model_len):
        if config.model.enforce_eager:
            return None
        made.append((CountingGraphRunner(model, kv_caches), max_model_len))
        return made[-1][0]

    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": list(range(3, 40))}]
    plain = LLM(str(tiny_model_dir("llama")), dtype="float32", max_model_len=128)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(CpuBackend, "graph_runner", graph_runner)
    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype="float32",
        max_model_len=128,
        enforce_eager=enforce_eager,
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    if enforce_eager:
        assert made == [] and llm.engine.runner.graph_runner is None
        return
    [(runner, max_model_len)] = made  # once, for the serving cache (not the profiling one)
    assert max_model_len == 128
    assert runner.kv_caches is llm.engine.runner.kv_caches
    assert llm.engine.runner.graph_runner is runner
    assert runner.calls == 5  # one prefill step and four decode steps


def test_unset_block_size_takes_the_backends_preferred_size(tiny_model_dir, caplog):
    from platform_core_cpu.plugin import capabilities

    caps = capabilities()

    with caplog.at_level(logging.INFO, logger="platform_core.engine"):
        llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory_bytes=1 << 22)
    assert llm.engine.config.cache.block_size == caps.preferred_block_size == 128
    assert "block_size 128 (backend cpu's preferred size)" in caplog.text
    chosen = LLM(str(tiny_model_dir("llama")), dtype="float32", block_size=32)
    assert chosen.engine.config.cache.block_size == 32  # a set size is kept
    dummy = LLM(str(tiny_model_dir("llama")), backend="dummy", dtype="float32")
    assert dummy.engine.config.cache.block_size == 32  # declares none: 16, then its adjustment


@pytest.mark.parametrize("requested", ["auto", "float32"])
def test_auto_dtype_takes_the_backends_choice_for_float32_checkpoints(
    tiny_model_dir, requested, caplog
):
    from platform_core_cpu.isa import host_isa
    from platform_core_cpu.plugin import capabilities

    caps = capabilities()
    assert caps.auto_float32_dtype == ("bfloat16" if host_isa().at_least("avx2") else None)
    with caplog.at_level(logging.INFO, logger="platform_core"):
        llm = LLM(str(tiny_model_dir("llama")), dtype=requested, backend="cpu")  # float32 ckpt
    chosen = caps.auto_float32_dtype if requested == "auto" else None
    assert (caps.auto_dtype_reason in caplog.text) == (chosen is not None)
    expected = chosen or "float32"  # an explicit float32 is kept
    assert llm.engine.config.model.dtype == expected
    assert {p.dtype for p in llm.engine.runner.model.parameters()} == {getattr(torch, expected)}
