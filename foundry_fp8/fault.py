"""An injected FP8 fault for fp8_guard's tests and `make run`'s demonstration.

`InjectOutlier` multiplies one input channel of one layer by `factor` in training forwards from
batch `start` on: an outlier feature. At 1e5 the tensor spans more than E4M3 holds with its
subnormals (448 / 2^-9, about 2.3e5, over a spread of values), so delayed scaling, which sizes
the scale for the outlier, flushes much of the rest to 0 at every step: persistent FP8 trouble
that a high-precision run of the same layer does not have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist
from torch import nn

from foundry_fp8.fp8_meta import canonical_modules


class InjectOutlier(Callback):
    """`callbacks: {inject_outlier: {layer: blocks.1.attn.out_proj, start: 6}}` (registered by the
    tests and the demo, not an entry point). `ranks`: only these ranks see the fault."""

    def __init__(self, layer: str, start: int, factor: float = 1e5, channel: int = 0,
                 ranks: Sequence[int] | None = None):
        self.layer, self.start, self.factor, self.channel = layer, start, factor, channel
        self.ranks = None if ranks is None else tuple(ranks)
        self._batch = 0

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.ranks is not None and dist.get_global_rank() not in self.ranks:
            return
        module = find_layer(state.model, self.layer)
        module.register_forward_pre_hook(self._scale)

    def batch_start(self, state: State, logger: Logger) -> None:
        self._batch = int(state.timestamp.batch)

    def _scale(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not module.training or self._batch < self.start:
            return None
        x = args[0].clone()
        x[..., self.channel] = x[..., self.channel] * self.factor
        return (x, *args[1:])


def find_layer(model: nn.Module, layer: str) -> nn.Module:
    """The module whose wrapper-free name is `layer` or ends with `.<layer>`."""
    for name, module in canonical_modules(model):
        if name == layer or name.endswith(f".{layer}"):
            return module
    raise KeyError(f"no module named {layer!r}")
