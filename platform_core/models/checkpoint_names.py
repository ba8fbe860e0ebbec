"""The checkpoint tensor names that fill a module's parameter."""

from __future__ import annotations

from torch import nn


def checkpoint_names(module_name: str, module: nn.Module, param_name: str) -> list[str]:
    """One name per fused part (``qkv_proj`` -> its ``q_proj``, ``k_proj``, ``v_proj``
    siblings), else the module's own: ``model.layers.0.self_attn.q_proj.weight``, ..."""
    parts = getattr(module, "checkpoint_parts", ())
    parent = module_name.rpartition(".")[0]
    names = [f"{parent}.{part}.{param_name}".lstrip(".") for part in parts]
    return names or [f"{module_name}.{param_name}".lstrip(".")]
