"""The ``apply_token_bitmask`` op: the core's reference against a per-token loop, the bit order
against masks xgrammar fills, and the CPU backend's compiled kernel (at every ISA level this CPU
runs) and the GPU backends' Triton kernel (under the interpreter, in a child process: this file
run as a script, as ``test_triton_kernels.py`` does) against the reference, exactly."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from json_child import collect, start_child

from platform_core.kernels.triton import triton_installed
from platform_core.layers.ops import LayerOps, resolve_ops
from platform_core.layers.token_bitmask import apply_token_bitmask

NEG_INF = float("-inf")
Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # logits, bitmask, rows
Op = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def naive(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The contract, one token at a time."""
    for i, row in enumerate(rows.tolist()):
        for t in range(logits.shape[1]):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                logits[row, t] = NEG_INF


def random_words(gen: torch.Generator, n: int, words: int) -> torch.Tensor:
    """Every 32-bit pattern equally likely (negative words included)."""
    return torch.randint(-(2**31), 2**31, (n, words), generator=gen, dtype=torch.int64).int()


def build_cases() -> dict[str, Case]:
    """Vocab sizes around and off multiples of 32, bitmasks wider than needed (with random bits
    past the vocab), rows a non-contiguous subset, no rows, all-zero, all-one and sparse masks."""
    gen = torch.Generator().manual_seed(7)
    cases: dict[str, Case] = {}
    for vocab in (1, 31, 32, 33, 67, 1000, 32005):
        for extra in (0, 2):
            words = -(-vocab // 32) + extra
            logits = torch.randn(7, vocab, generator=gen)
            rows = torch.tensor([5, 0, 3])
            cases[f"random-v{vocab}-w{words}"] = (logits, random_words(gen, 3, words), rows)
    logits = torch.randn(5, 1000, generator=gen)
    words = -(-1000 // 32)
    cases["all-zero"] = (logits, torch.zeros(2, words, dtype=torch.int32), torch.tensor([4, 1]))
    cases["all-one"] = (logits, torch.full((2, words), -1, dtype=torch.int32), torch.tensor([0, 2]))
    sparse = torch.zeros(3, words, dtype=torch.int32)
    sparse[0, 0], sparse[1, 31], sparse[2, 16] = 1, -(2**31), 0x00FF0F01
    cases["sparse"] = (logits, sparse, torch.tensor([1, 3, 4]))
    cases["no-rows"] = (logits, torch.zeros(0, words, dtype=torch.int32), torch.zeros(0).long())
    # Enough long rows for the kernel to split them across threads.
    many = torch.randn(40, 4099, generator=gen)
    cases["many-rows"] = (many, random_words(gen, 33, 129), torch.randperm(40, generator=gen)[:33])
    return cases


def applied(op: Op, case: Case) -> torch.Tensor:
    """The logits after ``op``, on a copy."""
    logits, bitmask, rows = case
    out = logits.clone()
    op(out, bitmask, rows)
    return out


def xgrammar_case() -> tuple[Case, set[int]]:
    """A bitmask xgrammar fills for ``root ::= "b" "a"`` over a 70-token vocab (three words, the
    last one partial), and the tokens it allows: ``b`` and ``ba``."""
    xgr = pytest.importorskip("xgrammar")
    vocab = ["<s>", *"abcdefghijklmnopqrstuvwxyz", "ab", "ba", "xyz"]
    vocab += [f"t{i}" for i in range(70 - len(vocab))]
    info = xgr.TokenizerInfo(vocab, vocab_size=len(vocab))
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar('root ::= "b" "a"'))
    bitmask = xgr.allocate_token_bitmask(2, len(vocab))
    matcher.fill_next_token_bitmask(bitmask, 1)  # row 0 stays all-allowed, as allocated
    logits = torch.randn(3, len(vocab), generator=torch.Generator().manual_seed(1))
    # Logits row 2 gets the grammar's mask, row 0 the all-allowed one, row 1 none.
    return (logits, bitmask, torch.tensor([0, 2])), {vocab.index("b"), vocab.index("ba")}


CASES = build_cases()


@pytest.mark.parametrize("name", ["random-v33-w2", "random-v67-w5", "random-v1-w3", "sparse"])
def test_the_reference_masks_as_the_per_token_loop_does(name):
    case = CASES[name]
    assert torch.equal(applied(apply_token_bitmask, case), applied(naive, case))


def test_the_reference_leaves_unnamed_rows_and_allowed_tokens_alone():
    logits, bitmask, rows = CASES["random-v1000-w34"]
    out = applied(apply_token_bitmask, (logits, bitmask, rows))
    others = [r for r in range(logits.shape[0]) if r not in rows.tolist()]
    assert torch.equal(out[others], logits[others])
    named = out[rows]
    kept = named != NEG_INF
    assert torch.equal(named[kept], logits[rows][kept])
    assert 0.4 < kept.float().mean().item() < 0.6  # random bits: about half the tokens banned


def test_the_reference_is_the_default_op():
    assert LayerOps().apply_token_bitmask is apply_token_bitmask
    assert resolve_ops({"apply_token_bitmask": naive}).apply_token_bitmask is naive


def test_the_bit_order_is_xgrammars():
    (logits, bitmask, rows), allowed = xgrammar_case()
    out = applied(apply_token_bitmask, (logits, bitmask, rows))
    assert set((out[2] != NEG_INF).nonzero().flatten().tolist()) == allowed
    assert torch.equal(out[[0, 1]], logits[[0, 1]])


def _cpu_ops(level: str) -> dict[str, Any]:
    """The level's override (``op``) and its compiled namespace (``raw``)."""
    kernels = pytest.importorskip("platform_core_cpu.kernels", reason="pip install -e backends/cpu")
    from platform_core_cpu.layer_ops import fused_layer_ops

    build = kernels.load_kernels(level)
    assert build.ops is not None, f"the {level} kernels must build here: {build.reason}"
    return {"op": fused_layer_ops(build.ops)["apply_token_bitmask"], "raw": build.ops}


def _levels() -> tuple[str, ...]:
    try:
        from platform_core_cpu.isa import host_isa
    except ImportError:
        return ()
    return host_isa().supported


@pytest.fixture(scope="module", params=_levels())
def cpu(request: pytest.FixtureRequest) -> dict[str, Any]:
    return _cpu_ops(request.param)


@pytest.mark.parametrize("name", list(CASES))
def test_the_cpu_kernel_matches_the_reference(cpu, name):
    case = CASES[name]
    assert torch.equal(applied(cpu["op"], case), applied(apply_token_bitmask, case))


def test_the_cpu_kernel_keeps_xgrammars_bit_order(cpu):
    case, allowed = xgrammar_case()
    out = applied(cpu["op"], case)
    assert set((out[2] != NEG_INF).nonzero().flatten().tolist()) == allowed
    assert torch.equal(out, applied(apply_token_bitmask, case))


def test_inputs_the_cpu_kernel_does_not_take_go_to_the_reference(cpu):
    logits, bitmask, rows = CASES["random-v67-w5"]
    want = applied(apply_token_bitmask, (logits, bitmask, rows))
    assert torch.equal(applied(cpu["op"], (logits, bitmask, rows.int())), want)
    wide = torch.empty(logits.shape[0], 2 * logits.shape[1])[:, ::2]  # rows not contiguous
    wide.copy_(logits)
    cpu["op"](wide, bitmask, rows)
    assert torch.equal(wide, want)


def test_the_cpu_kernel_refuses_rows_outside_the_logits(cpu):
    logits, bitmask, _ = CASES["random-v67-w5"]
    with pytest.raises(RuntimeError, match="row 7 is outside the 7 rows"):
        cpu["raw"].apply_token_bitmask(logits.clone(), bitmask, torch.tensor([0, 1, 7]))
    with pytest.raises(RuntimeError, match="1 words per row cannot hold 67 tokens"):
        cpu["raw"].apply_token_bitmask(logits.clone(), bitmask[:, :1], torch.tensor([0, 1, 2]))


def test_the_cpu_backend_offers_the_compiled_op():
    plugin = pytest.importorskip("platform_core_cpu.plugin")
    if plugin.CpuBackend().attention.compiled_ops() is None:
        pytest.skip("the compiled kernels are off here")
    op = plugin.CpuBackend().op_overrides()["apply_token_bitmask"]
    assert op.__name__ == "compiled_token_bitmask"


def _child_main() -> None:
    """Under the interpreter: which cases the Triton op gets right."""
    from platform_core.kernels.triton.ops import triton_op_overrides

    op = triton_op_overrides()["apply_token_bitmask"]
    results = {
        name: torch.equal(applied(op, case), applied(apply_token_bitmask, case))
        for name, case in CASES.items()
    }
    case, allowed = xgrammar_case()
    kept = (applied(op, case)[2] != NEG_INF).nonzero().flatten().tolist()
    results["xgrammar"] = set(kept) == allowed
    print(json.dumps(results))


@pytest.fixture(scope="module")
def triton_results() -> dict[str, bool]:
    if not triton_installed():
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return collect(start_child(__file__, "interpreted", env), "token bitmask")


@pytest.mark.parametrize("name", [*CASES, "xgrammar"])
def test_the_triton_kernel_matches_the_reference(triton_results, name):
    assert triton_results[name]


if __name__ == "__main__" and sys.argv[1:] == ["interpreted"]:
    _child_main()
