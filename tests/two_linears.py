"""The two-layer classifier net (16 -> 16 -> 4, ReLU between) of the plain Composer runs whose
fp8_stats dumps the tests read back: `blocks.0` and `blocks.1`, as te_swap numbers blocks."""

from __future__ import annotations

import torch
from torch import nn


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](torch.relu(self.blocks[0](x)))
