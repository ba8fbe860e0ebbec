"""Choosing the CPU backend's ISA level from CPU flags, forcing a lower one, and what each
level implies for the other paths (oneDNN's bf16 linears, native bf16 for ``dtype="auto"``)."""

from __future__ import annotations

import pytest
from platform_core_cpu import isa as cpu_isa
from platform_core_cpu.isa import ISA_ENV, resolve_isa, supported_levels
from platform_core_cpu.plugin import CpuBackend, describe_paths

from platform_core.errors import ConfigError

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ZEN4 = AVX512 | {"avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile"}
ALDER_LAKE = AVX2 | {"avx_ne_convert", "avx_vnni"}


@pytest.mark.parametrize(
    ("flags", "levels"),
    [
        (frozenset({"sse2"}), ("generic",)),
        (AVX2 - {"fma"}, ("generic",)),  # AVX2 without FMA is no x86-64-v3
        (AVX2, ("generic", "avx2")),
        (AVX512 - {"avx512vl"}, ("generic", "avx2")),
        (AVX512, ("generic", "avx2", "avx512")),
        (ZEN4, ("generic", "avx2", "avx512", "avx512_bf16")),
        (AVX2 | {"avx512_bf16"}, ("generic", "avx2")),  # levels build on each other
        (ZEN4 - {"avx512_vnni"}, ("generic", "avx2", "avx512")),  # its build uses VNNI too
    ],
)
def test_supported_levels_follow_the_flags(flags, levels):
    assert supported_levels(flags, "x86_64") == levels


def test_other_machines_get_the_generic_build():
    assert supported_levels(ZEN4, "aarch64") == ("generic",)


def test_the_highest_level_runs_unless_forced():
    chosen = resolve_isa(ZEN4, None, "x86_64")
    assert (chosen.level, chosen.forced) == ("avx512_bf16", False)
    forced = resolve_isa(ZEN4, "avx2", "x86_64")
    assert (forced.level, forced.forced) == ("avx2", True)
    assert forced.at_least("avx2") and not forced.at_least("avx512")
    assert "forced" in forced.describe() and "avx512_bf16" in forced.describe()


def test_forcing_an_unknown_or_missing_level_is_a_clear_error():
    with pytest.raises(ConfigError, match="not a level"):
        resolve_isa(ZEN4, "avx10", "x86_64")
    with pytest.raises(ConfigError, match="avx512_bf16"):
        resolve_isa(AVX512, "avx512_bf16", "x86_64")


@pytest.mark.parametrize(
    ("flags", "level", "native_bf16", "onednn_bf16"),
    [
        (AVX2, None, False, False),  # the AMD EPYC of issue 28
        (ALDER_LAKE, None, False, True),  # oneDNN's AVX-NE-CONVERT path
        (AVX512, None, False, True),
        (ZEN4, None, True, True),
        (SAPPHIRE_RAPIDS, None, True, True),
        (ZEN4, "avx2", False, False),  # forced: behaves as an AVX2 CPU throughout
        (SAPPHIRE_RAPIDS, "avx512", False, True),
    ],
)
def test_what_each_level_implies(flags, level, native_bf16, onednn_bf16):
    chosen = resolve_isa(flags, level, "x86_64")
    assert chosen.native_bf16 is native_bf16
    assert chosen.onednn_bf16 is onednn_bf16


def test_auto_dtype_and_listing_follow_the_level():
    zen4, avx2 = resolve_isa(ZEN4, None, "x86_64"), resolve_isa(AVX2, None, "x86_64")
    generic = resolve_isa(frozenset({"sse2"}), None, "x86_64")
    # bf16 from AVX2 up (measured faster there too: benchmarks/RESULTS.md), each with its reason.
    for isa in (zen4, avx2):
        caps = CpuBackend(isa).capabilities
        assert caps.auto_float32_dtype == "bfloat16" and "bytes" in caps.auto_dtype_reason
    assert "native" in CpuBackend(zen4).capabilities.auto_dtype_reason
    assert "AVX2" in CpuBackend(avx2).capabilities.auto_dtype_reason
    assert CpuBackend(generic).capabilities.auto_float32_dtype is None
    assert any("oneDNN" in line for line in describe_paths(zen4))
    assert any("widened" in line and "linears" in line for line in describe_paths(avx2))


def test_env_var_forces_the_host_level(monkeypatch):
    lowest = cpu_isa.host_isa().supported[0]
    monkeypatch.setenv(ISA_ENV, lowest)
    assert cpu_isa.host_isa().level == lowest
    monkeypatch.setenv(ISA_ENV, "no-such-level")
    with pytest.raises(ConfigError, match=ISA_ENV):
        cpu_isa.host_isa()


def test_the_slower_linear_path_is_logged_once_with_its_reason(caplog):
    import logging

    from platform_core_cpu import plugin

    plugin._log_linear_path.cache_clear()
    level = "avx2" if "avx2" in cpu_isa.host_isa().supported else "generic"
    forced = resolve_isa(cpu_isa.host_isa().flags, level)
    with caplog.at_level(logging.INFO, logger="platform_core_cpu"):
        CpuBackend(forced).op_overrides()
        CpuBackend(forced).op_overrides()
    lines = [r.message for r in caplog.records if "CPU bf16 linears" in r.message]
    assert len(lines) == 1
    assert ("AVX-512 or AVX-NE-CONVERT" in lines[0]) is not forced.onednn_bf16
