"""Command-line flags for every engine config key, and merging them with a YAML file.

Flags are generated from the config dataclasses, so a new config field is a new flag with no
extra code. Precedence: built-in defaults < ``--config FILE`` < flags given on the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from platform_core.config import _SECTIONS, EngineConfig, load_yaml_config

_HELP = {
    "model": "HF model directory, .gguf file, or a packaged model name (default: SmolLM2)",
    "backend": "backend name, or 'auto' for the best available one",
    "quantization": "gguf: keep a quantized GGUF's weights quantized (the default for one unless "
    "--dtype is given); int8 / int4 / fp8: quantize 16/32-bit weights at load time (fp8 also "
    "keeps an FP8 checkpoint's weights as stored); none: dequantize",
    "kv_transfer_config": "a KV connector for prefill/decode disaggregation, as JSON: "
    '\'{"kv_connector": "tcp", "kv_role": "kv_producer", "kv_port": 14579}\' (roles kv_producer, '
    "kv_consumer, kv_both; `platform-core kv-connectors` lists the connectors)",
}


def _parse_optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "") else int(text)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per engine config key (defaults are not set here)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--config", help="YAML file of engine config keys; flags override it")
    group.add_argument("--backend", default=argparse.SUPPRESS, help=_HELP["backend"])
    for section in _SECTIONS.values():
        for f in dataclasses.fields(section):
            flag = "--" + f.name.replace("_", "-")
            kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": f.name}
            if f.type in ("bool", bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            elif f.type in ("int", int):
                kwargs["type"] = int
            elif f.type in ("float", float):
                kwargs["type"] = float
            elif f.type in ("int | None",):
                kwargs["type"] = _parse_optional_int
            kwargs["help"] = _HELP.get(f.name, f"(default: {_default_of(f)})")
            group.add_argument(flag, **kwargs)


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config the command line asks for."""
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values.update(load_yaml_config(args.config))
    valid = {f.name for s in _SECTIONS.values() for f in dataclasses.fields(s)} | {"backend"}
    values.update({k: v for k, v in vars(args).items() if k in valid})
    return EngineConfig.from_flat(**values)
