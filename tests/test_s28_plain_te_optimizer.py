"""`convert_to_fp8(model, SwapConfig(backend="te"))` in a plain loop whose optimizer was built
before the conversion and not passed as `optimizers=`: te.Linear holds new Parameter objects, so
that optimizer kept stepping the replaced nn.Linear parameters, which no forward uses any more,
and the converted layers never trained, silently (a GPU run; here the stand-in TE of
tests/fake_te.py, with TE's parameter names). The emulated backend keeps the model's own
Parameter objects and is unaffected.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from foundry_fp8.swap import SwapConfig, convert_to_fp8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_an_optimizer_built_before_conversion_trains_the_te_layers_or_is_named(fake_te):
    fake_te()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_to_fp8(model, SwapConfig(backend="te"))
    if any("optimizer" in str(w.message) for w in caught):
        return  # named: the user is told to pass it
    up = model.blocks[0].up
    before = up.weight.detach().clone()
    model(torch.randn(8, 32)).pow(2).sum().backward()
    assert up.weight.grad is not None
    optimizer.step()
    assert not torch.equal(up.weight.detach(), before), "the TE layer's weight did not train"
