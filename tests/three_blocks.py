"""A model of three transformer-like blocks, numbered as te_swap numbers them (`blocks.<i>.fc`),
and what te_swap keeps out of FP8 when given an advised change: the tests of the edge-block
advice (fp8_stats' warnings, fp8_guard's reasons) follow the advice with te_swap's own plan."""

from __future__ import annotations

import torch
from torch import nn

from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import plan_swap


class ThreeBlocks(nn.Module):
    """Three blocks of one `linear(16, 16)` each, run in a row (seeded: the same weights)."""

    def __init__(self, linear: type[nn.Module] = nn.Linear) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc": linear(16, 16)}) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block["fc"](x)
        return x


def kept_by_te_swap(model: nn.Module, change: dict[str, object]) -> set[str]:
    """The layers te_swap's plan leaves in high precision with `change` in its options."""
    return {d.name for d in plan_swap(model, SwapConfig(backend="emulate", **change)).decisions
            if not d.convert}
