"""GGUF files for tests: tiny seeded ones written here, and transformers' reading as reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from platform_core.quantization.formats import QUANT_FORMATS
from platform_core.quantization.formats import random_blocks as core_random_blocks

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 64, 96, 4, 2, 2, 80


def random_blocks(rows: int, columns: int, qtype: gguf.GGMLQuantizationType, rng: Any) -> Any:
    """``uint8 [rows, row_bytes]`` blocks of ``qtype``: quantized from normal values where the
    gguf package can quantize the type, else random bytes with small float16 scales."""
    values = rng.standard_normal((rows, columns)).astype(np.float32)
    try:
        return gguf.quants.quantize(values, qtype)
    except NotImplementedError:  # K-quants: random bytes, weights of a normal's RMS
        gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
        return core_random_blocks(rows, columns, QUANT_FORMATS[qtype.name], 1.0, gen).numpy()


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    tied: bool = True,
    seed: int = 0,
    qtype: gguf.GGMLQuantizationType | None = None,
    hidden: int = HIDDEN,
    ffn: int = FFN,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """A small seeded GGUF (no tokenizer). By default it mixes F32, F16, Q8_0 and Q4_1 tensors
    (fused parts of one linear in different formats among them); with ``qtype`` every linear
    is ``qtype`` and the embedding Q8_0. ``types`` sets the type of single tensors by name."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(50000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    qtypes = [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1]

    def add(name: str, shape: tuple[int, ...]) -> None:
        if name in (types or {}):
            writer.add_tensor(name, random_blocks(*shape, types[name], rng), raw_dtype=types[name])
            return
        if qtype is not None and len(shape) == 2:
            kind = gguf.GGMLQuantizationType.Q8_0 if name.startswith("token_embd") else qtype
            writer.add_tensor(name, random_blocks(*shape, kind, rng), raw_dtype=kind)
            return
        values = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1:  # norms and biases
            writer.add_tensor(name, values)
        elif name.startswith("blk.1."):
            writer.add_tensor(name, values.astype(np.float16))
        else:
            mixed = qtypes[len(name) % 2]
            writer.add_tensor(name, gguf.quants.quantize(values, mixed), raw_dtype=mixed)

    head_dim = hidden // HEADS
    add("token_embd.weight", (VOCAB, hidden))
    add("output_norm.weight", (hidden,))
    if not tied:
        add("output.weight", (VOCAB, hidden))
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (hidden,))
        add(f"blk.{i}.ffn_norm.weight", (hidden,))
        for part, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            add(f"blk.{i}.attn_{part}.weight", (rows * head_dim, hidden))
            if arch == "qwen2":
                add(f"blk.{i}.attn_{part}.bias", (rows * head_dim,))
        add(f"blk.{i}.attn_output.weight", (hidden, hidden))
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_gguf(
    path: Path, skeleton_config: Any = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Config and float32 tensors as transformers' own GGUF loader produces them.

    The loader names tensors after a model skeleton; ``skeleton_config`` (default: transformers'
    config parsed from the GGUF) saves one slow parse of a large file. A wrong layer count in it
    would show up as missing or extra tensor names.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = skeleton_config or AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):  # only names are needed to map tensors; no weights allocated
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
    return parsed["config"], parsed["tensors"]


def file_identity(path: Path) -> tuple[int, int]:
    """(inode, mtime): changes when a file is rewritten, not when it is only read."""
    info = path.stat()
    return info.st_ino, info.st_mtime_ns
