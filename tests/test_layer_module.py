"""LayerModule: our layers are called straight through their forward, without hooks."""

from __future__ import annotations

import pytest
import torch

from platform_core.layers.module import LayerModule
from platform_core.layers.norm import RMSNorm, rms_norm


class Doubler(LayerModule):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return 2 * x


def test_calling_a_layer_runs_its_own_forward():
    layer = Doubler()
    assert torch.equal(layer(torch.ones(3)), torch.full((3,), 2.0))
    assert layer.calls == 1
    layer.forward = lambda x: x + 1  # an instance's own forward is the one called
    assert torch.equal(layer(torch.ones(3)), torch.full((3,), 2.0))
    assert layer.calls == 1
    norm = RMSNorm(4, 1e-6, torch.float32, rms_norm)
    norm.weight.data.fill_(1.0)
    x = torch.randn(2, 4)
    assert torch.equal(norm(x), rms_norm(x, norm.weight, 1e-6))


@pytest.mark.parametrize(
    "register",
    ["register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook"],
)
def test_registering_a_hook_raises_instead_of_being_ignored(register):
    with pytest.raises(TypeError, match=r"without nn\.Module hooks"):
        getattr(Doubler(), register)(lambda *args: None)
