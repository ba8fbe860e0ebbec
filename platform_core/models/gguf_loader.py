"""Read a GGUF checkpoint and materialize it once as a cached Hugging Face model directory.

A materialized directory holds ``config.json``, a float32 ``model.safetensors``, the tokenizer files
(with the chat template), ``generation_config.json`` and, written last, ``manifest.json`` listing
every file with its size and sha256. A directory whose manifest is missing, unreadable, or
disagrees with the file sizes on disk is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from platform_core.errors import ModelLoadError

logger = logging.getLogger("platform_core.models")

CACHE_ENV = "PLATFORM_CORE_CACHE"
MANIFEST_NAME = "manifest.json"
_MANIFEST_FORMAT = 1
_MIB = 1 << 20
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


def default_cache_dir() -> Path:
    """``$PLATFORM_CORE_CACHE``, or ``~/.cache/platform-core`` when it is unset."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "platform-core")


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
    ids = _special_token_ids(reader)
    config.update({f"{kind}_token_id": ids[kind] for kind in ("bos", "eos", "pad") if kind in ids})
    return config


def gguf_state_dict(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32, keyed by its Hugging Face name."""
    permuted = _ARCHITECTURES[config["model_type"]][1]
    rope_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    state: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor"):
        name = hf_tensor_name(tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        heads = rope_heads.get(tensor.name.split(".")[-2])  # blk.N.attn_q.weight -> attn_q
        if permuted and heads is not None:
            values = unpermute_rope_rows(values, heads)
        state[name] = torch.from_numpy(np.array(values, dtype=np.float32))
    return state


def write_hf_model_dir(gguf_path: Path, folder: Path) -> None:
    """Write config, float32 safetensors, tokenizer, generation config and manifest into folder."""
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    config = gguf_config(reader)
    save_file(gguf_state_dict(reader, config), folder / "model.safetensors", {"format": "pt"})
    _write_json(folder / "config.json", config)
    token_keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    _write_json(
        folder / "generation_config.json", {k: config[k] for k in token_keys if k in config}
    )
    if "tokenizer.ggml.model" in reader.fields:
        _write_tokenizer(gguf_path, folder, _special_token_ids(reader), config)
    else:
        logger.warning("%s has no tokenizer metadata; no tokenizer files written", gguf_path)
    files = {
        path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    _write_json(folder / MANIFEST_NAME, {"format": _MANIFEST_FORMAT, "files": files})


def manifest_problem(folder: Path, checksums: bool = False) -> str | None:
    """Why a materialized folder is unusable, or None when its manifest matches the files.

    Sizes are always compared (this catches truncation); ``checksums=True`` also recomputes every
    sha256, about 0.5 s for SmolLM2-135M's 540 MB of float32 weights, so the cache lookup skips it.
    """
    if not folder.is_dir():
        return "not materialized yet"
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        files = manifest["files"] if manifest["format"] == _MANIFEST_FORMAT else None
    except FileNotFoundError:
        return "manifest is missing"
    except (OSError, ValueError, KeyError, TypeError):
        return "manifest is unreadable"
    if not isinstance(files, dict) or not files:
        return "manifest has an unknown format"
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["size"]:
            return f"{name} has {path.stat().st_size} bytes, manifest says {entry['size']}"
        if checksums and _sha256(path) != entry["sha256"]:
            return f"{name} does not match its sha256"
    return None


def materialize_gguf(
    gguf_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Return a cached HF model directory for a GGUF file, building it on first use.

    The cache folder is ``<cache_dir or default_cache_dir()>/gguf/<stem>-<key>``, where the key
    hashes the file's size, mtime and first and last MiB (constant cost for any file size). The
    folder is built in a temporary sibling and renamed into place, so readers never see half of it.
    """
    source = Path(gguf_path).expanduser().resolve()
    if not source.is_file():
        raise ModelLoadError(f"GGUF file {source} does not exist")
    target = Path(cache_dir or default_cache_dir()) / "gguf" / _cache_key(source)
    problem = manifest_problem(target)
    if problem is None:
        logger.info("using cached model %s for %s", target, source)
        return target
    log = logger.warning if target.exists() else logger.info
    log("materializing %s into %s (%s)", source, target, problem)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(target, "tmp")
    tmp.mkdir()  # unlike mkdtemp's 0700, honours the umask like the rest of the cache
    try:
        write_hf_model_dir(source, tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished folder into place, replacing a broken one."""
    if target.exists():
        stale = _sibling(target, "stale")
        target.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:
        # Another process published the same model between our check and now.
        if manifest_problem(target) is not None:
            raise
        logger.info("%s was materialized concurrently; using that copy", target)


def _sibling(target: Path, tag: str) -> Path:
    return target.with_name(f".{tag}-{target.name}-{uuid.uuid4().hex[:12]}")


def _write_tokenizer(
    gguf_path: Path, folder: Path, special_ids: dict[str, int], config: dict[str, Any]
) -> None:
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


def _special_token_ids(reader: gguf.GGUFReader) -> dict[str, int]:
    ids = {
        hf: _field(reader, f"tokenizer.ggml.{name}_token_id", None)
        for hf, name in _SPECIAL_TOKENS.items()
    }
    return {kind: int(token_id) for kind, token_id in ids.items() if token_id is not None}


def _cache_key(path: Path) -> str:
    stat = path.stat()
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    with path.open("rb") as f:
        digest.update(f.read(_MIB))
        f.seek(max(stat.st_size - _MIB, 0))
        digest.update(f.read(_MIB))
    return f"{path.stem}-{digest.hexdigest()[:16]}"


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 * _MIB):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
