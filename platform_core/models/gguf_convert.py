"""Translate a GGUF checkpoint into Hugging Face form: ``config.json`` keys, float32 tensors under
their HF names (with llama.cpp's rope row order undone), the quantized tensors' blocks as stored
(rows reordered the same way), and the tokenizer files.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

from platform_core.errors import ModelLoadError

_REQUIRED = object()

# GGUF architecture -> (HF model class, whether llama.cpp reordered the Q/K rows for its rope)
_ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}
_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TENSOR_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")
_SPECIAL_TOKENS = {"bos": "bos", "eos": "eos", "pad": "padding", "unk": "unknown"}  # HF -> GGUF


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor (``blk.3.attn_q.weight`` -> ...)."""
    match = _TENSOR_NAME.fullmatch(gguf_name)
    layer, part, kind = match.groups() if match else (None, None, None)
    if layer is None and part in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[part]}.{kind}"
    if layer is not None and part in _BLOCK_NAMES:
        return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent we know of")


def unpermute_rope_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order.

    Per head, llama.cpp stores the rotary pairs interleaved (x0, y0, x1, y1, ...) while HF keeps the
    two halves apart (x0, x1, ..., y0, y1, ...) for its rotate-half rope.
    """
    head_dim = rows.shape[0] // num_heads
    pairs = rows.reshape(num_heads, head_dim // 2, 2, *rows.shape[1:])
    return pairs.swapaxes(1, 2).reshape(rows.shape)


def gguf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Map GGUF metadata to a Hugging Face ``config.json`` dict (llama and qwen2)."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported")

    def meta(key: str, default: Any = _REQUIRED) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    heads, hidden = meta("attention.head_count"), meta("embedding_length")
    config = {
        "architectures": [_ARCHITECTURES[arch][0]],
        "model_type": arch,
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length", hidden // heads),
        "max_position_embeddings": meta("context_length"),
        "rms_norm_eps": _shortest_float32(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest_float32(meta("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    ids = special_token_ids(reader)
    config.update({f"{kind}_token_id": ids[kind] for kind in ("bos", "eos", "pad") if kind in ids})
    return config


_UNQUANTIZED = {
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
}


def _rope_rows(
    reader: gguf.GGUFReader, config: dict[str, Any]
) -> Callable[[Any, np.ndarray], np.ndarray]:
    """``rows(tensor, array)``: the array with llama.cpp's Q/K row order undone where it applies
    (the array's rows are the tensor's output rows, as values or as blocks)."""
    permuted = _ARCHITECTURES[config["model_type"]][1]
    rope_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    def rows(tensor: Any, array: np.ndarray) -> np.ndarray:
        heads = rope_heads.get(tensor.name.split(".")[-2])  # blk.N.attn_q.weight -> attn_q
        return unpermute_rope_rows(array, heads) if permuted and heads is not None else array

    return rows


def gguf_state_dict(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32, keyed by its Hugging Face name."""
    rows = _rope_rows(reader, config)
    state: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor"):
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        values = rows(tensor, values)
        state[hf_tensor_name(tensor.name)] = torch.from_numpy(np.array(values, dtype=np.float32))
    return state


def gguf_quantized_tensors(
    reader: gguf.GGUFReader, config: dict[str, Any]
) -> dict[str, tuple[np.ndarray, str]]:
    """Every quantized tensor's blocks as stored, ``uint8 [rows, row_bytes]``, with its GGML
    type name, keyed by its Hugging Face name (1-D tensors, which are never quantized, and
    16/32-bit ones are left out)."""
    rows = _rope_rows(reader, config)
    quantized = {}
    for tensor in reader.tensors:
        if tensor.tensor_type in _UNQUANTIZED or len(tensor.shape) != 2:
            continue
        blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(int(tensor.shape[1]), -1)
        quantized[hf_tensor_name(tensor.name)] = (rows(tensor, blocks), tensor.tensor_type.name)
    return quantized


def write_tokenizer(
    gguf_path: Path, folder: Path, special_ids: dict[str, int], config: dict[str, Any]
) -> None:
    """Save the GGUF's tokenizer (with its chat template) into ``folder`` in HF form."""
    # Deferred: a slow import only needed here. The fast-tokenizer class is what AutoTokenizer
    # returns for GGUF files too, and naming it skips AutoConfig's second parse of the file.
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # transformers' GGUF converter derives the eos token from the bos id (SmolLM2 would stop on
    # <|im_start|>), so every special token is set again from the ids in the metadata.
    for kind, token_id in special_ids.items():
        setattr(tokenizer, f"{kind}_token", tokenizer.convert_ids_to_tokens(token_id))
    tokenizer.model_max_length = config["max_position_embeddings"]
    tokenizer.save_pretrained(folder)


def special_token_ids(reader: gguf.GGUFReader) -> dict[str, int]:
    """The ids of the special tokens (bos, eos, pad, unk) that the GGUF metadata names."""
    ids = {
        hf: _field(reader, f"tokenizer.ggml.{name}_token_id", None)
        for hf, name in _SPECIAL_TOKENS.items()
    }
    return {kind: int(token_id) for kind, token_id in ids.items() if token_id is not None}


def _field(reader: gguf.GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    field = reader.fields.get(key)
    if field is not None:
        return field.contents()
    if default is _REQUIRED:
        raise ModelLoadError(f"GGUF metadata key {key!r} is missing")
    return default


def _shortest_float32(value: float) -> float:
    # GGUF stores float32; its shortest decimal form gives back the intended 1e-05, not 9.99e-06.
    return float(str(np.float32(value)))
