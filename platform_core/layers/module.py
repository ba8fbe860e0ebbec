"""``LayerModule``: the ``nn.Module`` base of our layers, called without hook bookkeeping."""

from __future__ import annotations

from typing import Any, NoReturn

from torch import nn


class LayerModule(nn.Module):
    """An ``nn.Module`` whose call is its ``forward``, with nothing in between.

    ``nn.Module.__call__`` checks for hooks on every call (about 1.5 us, and a decode step of a
    30-layer model makes some 300 such calls: about 0.4 ms per token at batch 1 on a CPU, see
    ``benchmarks/RESULTS.md``). The engine registers no hooks, so calling a layer calls its
    ``forward``; registering a hook on one raises rather than being silently skipped.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def _hooks_unsupported(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} runs without nn.Module hooks (its call is its forward); "
            "wrap the module instead"
        )

    register_forward_hook = _hooks_unsupported
    register_forward_pre_hook = _hooks_unsupported
    register_full_backward_hook = _hooks_unsupported
    register_full_backward_pre_hook = _hooks_unsupported
