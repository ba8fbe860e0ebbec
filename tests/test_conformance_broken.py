"""The conformance suite fails deliberately broken backends, naming the faulty piece, and passes
the correct one (``tests/conformance_backends.py``: in-process plugins, nothing installed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conformance_backends import (
    CAPABILITIES,
    DEFAULT_OPS,
    Bf16Raises,
    CausalOffByOneAfterPrefix,
    FixturePlugin,
    PaddingWritten,
    ScaledAttention,
    WrongGqaMapping,
    fp16_rms_norm,
    linear_without_bias,
    quantized_linear_on_8bit_inputs,
    quantized_linear_without_offset,
    rms_norm_without_eps,
)
from platform_core_conformance import run_conformance
from platform_core_conformance.op_checks import lora_mapping

from platform_core.backend_api import (
    LoRAMapping,
    ReferenceAttentionOps,
    apply_token_bitmask,
    lora_expand,
    lora_shrink,
)

# What in-process backends can run (the engine loads installed backends only).
UNIT_CHECKS = "test_kernels or test_kv_blocks or test_ops or test_registration"
OPS = "test_ops or test_registration"
OP_CHECK, QUANTIZED = "test_op_override_matches_the_core_default", "quantized_linear"
WITH_FP16 = dataclasses.replace(CAPABILITIES, dtypes=("float32", "float16"))
BITMASK = "apply_token_bitmask"
SHRINK, EXPAND = "lora_shrink", "lora_expand"
KV_EXPORT, KV_ROUND_TRIP = (
    "test_kv_block_export_after_write_kv",
    "test_kv_block_import_export_round_trip",
)
KV_ATTENTION = "test_kv_block_import_then_attention"


def token_bitmask_without_tail(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """Masks whole words only: the last ``vocab % 32`` tokens stay allowed (a kernel missing
    its tail loop)."""
    apply_token_bitmask(logits[:, : logits.shape[1] // 32 * 32], bitmask, rows)


def lora_shrink_reusing_part_0(
    x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping
) -> torch.Tensor:
    """Every part of a fused projection with the first part's A (a wrong part stride)."""
    return lora_shrink(x, lora_a[:, :1].expand_as(lora_a), mapping)


def lora_expand_wrapping_slot_minus_1(
    out: torch.Tensor,
    buffer: torch.Tensor,
    lora_b: torch.Tensor,
    slice_sizes: tuple[int, ...],
    mapping: LoRAMapping,
) -> None:
    """Base-model tokens get the last slot's adapter (``lora_b[-1]``: slot -1 used as an
    index)."""
    slots = mapping.token_slots.clone()
    slots[slots < 0] = mapping.max_slots - 1
    wrapped = lora_mapping(tuple(slots.tolist()), mapping.max_slots)
    lora_expand(out, buffer, lora_b, slice_sizes, wrapped)


class ExportSwappingTokens(ReferenceAttentionOps):
    """Exports tokens 0 and 1 of every block in each other's place (a wrong token stride)."""

    def export_blocks(self, kv_cache, block_ids, *, block_size, head_size):
        blocks = super().export_blocks(
            kv_cache, block_ids, block_size=block_size, head_size=head_size
        )
        return blocks[:, :, [1, 0, *range(2, block_size)]]


class ImportSwappingKV(ReferenceAttentionOps):
    """Imports keys as values and values as keys."""

    def import_blocks(self, kv_cache, block_ids, blocks):
        super().import_blocks(kv_cache, block_ids, blocks.flip(0))


def _checks(plugin: FixturePlugin, keyword: str, tmp_path: Path) -> tuple[int, dict[str, Any]]:
    """Run the suite on ``plugin``; the exit code and the report's checks by short name."""
    report = tmp_path / f"{plugin.name}.json"
    code = run_conformance(plugin.name, report=report, keyword=keyword, backend_plugins=[plugin])
    doc = json.loads(report.read_text())
    return code, {c["id"].split("::")[-1]: c for c in doc["checks"]}


def _failed(checks: dict[str, Any]) -> dict[str, str]:
    return {name: c["message"] for name, c in checks.items() if c["outcome"] == "failed"}


def test_the_correct_fixture_backend_passes_every_unit_check(tmp_path: Path) -> None:
    plugin = FixturePlugin("correct", overrides=dict(DEFAULT_OPS))
    code, checks = _checks(plugin, UNIT_CHECKS, tmp_path)
    assert code == 0, _failed(checks)
    ops = [name for name in checks if name.startswith("test_op_override_matches")]
    # Every overridable op, in both declared dtypes, on several cases each.
    assert {name.split("-")[1] for name in ops} == set(DEFAULT_OPS)
    assert len(ops) > 2 * len(DEFAULT_OPS)


# name -> (plugin, checks to run, {failing check: text its message must contain}, passing checks)
CATALOGUE: dict[str, tuple[FixturePlugin, str, dict[str, str], list[str]]] = {
    "causal-off-by-one": (
        FixturePlugin("causal-off-by-one", CausalOffByOneAfterPrefix),
        "test_paged_attention",
        {"test_paged_attention[float32-prefill_after_cached_prefix]": "token position"},
        ["test_paged_attention[float32-prefill]", "test_paged_attention[bfloat16-prefill]"],
    ),
    "scale-2pct": (
        FixturePlugin("scale-2pct", lambda: ScaledAttention(1.02)),
        "test_kernels and bfloat16",
        {
            "test_paged_attention[bfloat16-decode]": "worst at sequence",
            # Every element within the loose bf16 bound: only the RMS bound catches it.
            "test_paged_attention[bfloat16-prefill]": "relative RMS error 0.01",
            "test_gqa_ratios[bfloat16-gqa8-kv2]": "kv head",
        },
        ["test_paged_attention[bfloat16-one_token]", "test_padding_slots_write_nothing[bfloat16]"],
    ),
    "gqa-mapping": (
        FixturePlugin("gqa-mapping", WrongGqaMapping),
        "test_gqa_ratios and float32",
        {"test_gqa_ratios[float32-gqa8-kv2]": "(kv head "},
        ["test_gqa_ratios[float32-gqa1-kv16]"],
    ),
    "bf16-raises": (
        FixturePlugin("bf16-raises", Bf16Raises),
        "test_paged_attention and mixed",
        {"test_paged_attention[bfloat16-mixed]": "bf16 paged attention kernel is missing"},
        ["test_paged_attention[float32-mixed]"],
    ),
    "fp16-norm-overflow": (
        FixturePlugin(
            "fp16-norm-overflow", overrides={"rms_norm": fp16_rms_norm}, capabilities=WITH_FP16
        ),
        OPS,
        {
            "test_op_override_matches_the_core_default[float16-rms_norm-large-x[4, 64]]": (
                "op override 'rms_norm' vs the core's default (float16, case large"
            )
        },
        ["test_op_override_matches_the_core_default[float32-rms_norm-large-x[4, 64]]"],
    ),
    "rms-norm-no-eps": (
        FixturePlugin("rms-norm-no-eps", overrides={"rms_norm": rms_norm_without_eps}),
        OPS,
        {
            "test_op_override_matches_the_core_default[float32-rms_norm-tiny-x[4, 64]]": (
                "op override 'rms_norm'"
            )
        },
        ["test_op_override_matches_the_core_default[float32-rms_norm-odd-x[5, 67]]"],
    ),
    "linear-no-bias": (
        FixturePlugin("linear-no-bias", overrides={"linear": linear_without_bias}),
        OPS,
        {
            "test_op_override_matches_the_core_default[bfloat16-linear-rows-7x64->48-bias]": (
                "op override 'linear'"
            )
        },
        ["test_op_override_matches_the_core_default[bfloat16-linear-odd-7x67->33-nobias]"],
    ),
    "quantized-no-offset": (
        FixturePlugin(
            "quantized-no-offset", overrides={"quantized_linear": quantized_linear_without_offset}
        ),
        OPS,
        {f"{OP_CHECK}[float32-{QUANTIZED}-one-row-Q4_1-1x96->37-bias]": "override 'quantized_"},
        [f"{OP_CHECK}[float32-{QUANTIZED}-rows-Q8_0-9x64->37-nobias]"],
    ),
    "bitmask-no-tail": (
        FixturePlugin("bitmask-no-tail", overrides={BITMASK: token_bitmask_without_tail}),
        OPS,
        {
            f"{OP_CHECK}[float32-{BITMASK}-odd-3of5x33-w2]": "override 'apply_token_bitmask'",
            f"{OP_CHECK}[bfloat16-{BITMASK}-short-2of4x31-w1]": "elements at [[",
        },
        [f"{OP_CHECK}[float32-{BITMASK}-none-0of3x67-w3]"],
    ),
    "lora-shrink-one-part": (
        FixturePlugin("lora-shrink-one-part", overrides={SHRINK: lora_shrink_reusing_part_0}),
        OPS,
        {
            f"{OP_CHECK}[float32-{SHRINK}-one-token-t1-in67-s3-r8]": "override 'lora_shrink'",
            f"{OP_CHECK}[bfloat16-{SHRINK}-prefill-t100-in96-s3-r8]": "override 'lora_shrink'",
        },
        [
            f"{OP_CHECK}[float32-{SHRINK}-decode-t9-in33-s1-r1]",
            f"{OP_CHECK}[bfloat16-{SHRINK}-prefill-t100-in64-s1-r16]",
        ],
    ),
    "lora-expand-slot-minus-1": (
        FixturePlugin(
            "lora-expand-slot-minus-1", overrides={EXPAND: lora_expand_wrapping_slot_minus_1}
        ),
        OPS,
        {
            f"{OP_CHECK}[float32-{EXPAND}-decode-t9-n40+24-r16]": "override 'lora_expand'",
            f"{OP_CHECK}[bfloat16-{EXPAND}-base-only-t6-n40+24-r8]": "override 'lora_expand'",
        },
        [f"{OP_CHECK}[float32-{EXPAND}-one-token-t1-n64+16+33-r8]"],
    ),
    "kv-export-swapping-tokens": (
        FixturePlugin("kv-export-swapping-tokens", ExportSwappingTokens),
        "test_kv_blocks",
        {
            f"{KV_EXPORT}[float32-h32-b16]": "export_blocks after write_kv: ",
            f"{KV_EXPORT}[bfloat16-h32-b16]": ", token 0, kv head",
            f"{KV_ROUND_TRIP}[float32-h32-b16]": "export_blocks after import_blocks",
        },
        [f"{KV_ATTENTION}[float32-gqa4-kv2]", "test_kv_block_empty_list[bfloat16]"],
    ),
    "kv-import-swapping-kv": (
        FixturePlugin("kv-import-swapping-kv", ImportSwappingKV),
        "test_kv_blocks",
        {
            f"{KV_ROUND_TRIP}[bfloat16-h32-b16]": "the first in the keys of block 4",
            f"{KV_ATTENTION}[float32-gqa2-kv4]": "imported blocks vs reference",
        },
        [f"{KV_EXPORT}[float32-h32-b16]"],
    ),
    "misspelt-override": (
        FixturePlugin("misspelt-override", overrides={"rmsnorm": DEFAULT_OPS["rms_norm"]}),
        OPS,
        {"test_op_overrides_are_known_callables": "'rmsnorm' (did you mean 'rms_norm'?)"},
        ["test_capabilities_are_well_formed"],
    ),
}


@pytest.mark.parametrize("bug", list(CATALOGUE))
def test_a_broken_backend_fails_naming_the_faulty_piece(bug: str, tmp_path: Path) -> None:
    plugin, keyword, failing, passing = CATALOGUE[bug]
    code, checks = _checks(plugin, keyword, tmp_path)
    assert code == pytest.ExitCode.TESTS_FAILED
    failed = _failed(checks)
    for name, text in failing.items():
        assert name in failed, f"{name} did not fail: {checks.get(name)}"
        assert text in failed[name], failed[name]
    for name in passing:
        assert checks[name]["outcome"] == "passed", checks[name]


def test_wrong_padding_fails_once_and_its_dependents_say_why_they_skipped(tmp_path: Path) -> None:
    plugin = FixturePlugin("padding-written", PaddingWritten)
    code, checks = _checks(plugin, "test_kernels and bfloat16", tmp_path)
    assert code == pytest.ExitCode.TESTS_FAILED
    failed = _failed(checks)
    assert list(failed) == ["test_padding_slots_write_nothing[bfloat16]"], failed
    assert "writing only -1 slots changed" in failed["test_padding_slots_write_nothing[bfloat16]"]
    assert checks["test_write_kv_stores_every_element[bfloat16]"]["outcome"] == "passed"
    dependent = checks["test_paged_attention[bfloat16-mixed]"]
    assert dependent["outcome"] == "skipped"
    assert dependent["message"] == (
        "skipped because prerequisite test_padding_slots_write_nothing[bfloat16] (padding) failed"
    )


def test_a_kernel_rounding_its_inputs_to_8_bits_passes_the_quantized_checks(tmp_path: Path) -> None:
    """The quantized linear's floor admits integer-dot kernels (and the cases do run)."""
    plugin = FixturePlugin(
        "int8-inputs", overrides={"quantized_linear": quantized_linear_on_8bit_inputs}
    )
    code, checks = _checks(plugin, OPS, tmp_path)
    assert code == 0, _failed(checks)
    ran = [name for name in checks if "quantized_linear" in name]
    assert len(ran) == 2 * 6 * 2, ran  # dtypes x formats (five GGML, FP8) x cases
