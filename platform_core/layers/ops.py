"""The ops a backend may replace (``Backend.op_overrides``), resolved once at model build.

Names and signatures:

- ``"rms_norm"``: :data:`platform_core.layers.norm.RmsNormFn`
- ``"rotary"``: :data:`platform_core.layers.rotary.RotaryFn`
- ``"silu_and_mul"``: :data:`platform_core.layers.activation.SiluAndMulFn`
- ``"linear"``: :data:`platform_core.layers.linear.LinearFn` (``F.linear``'s signature)
- ``"argmax"``: :data:`platform_core.sample.sampler.ArgmaxFn` (the sampler's row argmax)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from platform_core.layers.activation import SiluAndMulFn, silu_and_mul
from platform_core.layers.linear import LinearFn
from platform_core.layers.norm import RmsNormFn, rms_norm
from platform_core.layers.rotary import RotaryFn, apply_rotary
from platform_core.sample.sampler import ArgmaxFn, row_argmax

logger = logging.getLogger(__name__)

OVERRIDABLE_OPS = ("rms_norm", "rotary", "silu_and_mul", "linear", "argmax")


@dataclass(frozen=True, slots=True)
class LayerOps:
    """The op implementations every layer of one model, and its sampler, use."""

    rms_norm: RmsNormFn = rms_norm
    rotary: RotaryFn = apply_rotary
    silu_and_mul: SiluAndMulFn = silu_and_mul
    linear: LinearFn = F.linear
    argmax: ArgmaxFn = row_argmax


def resolve_ops(overrides: Mapping[str, Callable[..., Any]] | None) -> LayerOps:
    """Defaults replaced by ``overrides``; unknown names are logged and ignored, so a backend
    written for a newer core still loads."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(OVERRIDABLE_OPS))
    if unknown:
        logger.warning("ignoring unknown op overrides %s; known: %s", unknown, OVERRIDABLE_OPS)
    return LayerOps(**{name: fn for name, fn in overrides.items() if name in OVERRIDABLE_OPS})
