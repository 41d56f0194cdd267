"""`convert_to_fp8(model, SwapConfig(backend="te"))` in a plain loop whose optimizer was built
before the conversion and not passed as `optimizers=`: te.Linear holds new Parameter objects, so
that optimizer kept stepping the replaced nn.Linear parameters, which no forward uses any more,
and the converted layers never trained, silently (a GPU run; here the stand-in TE of
tests/fake_te.py, with TE's parameter names). The emulated backend keeps the model's own
Parameter objects and is unaffected.
"""

from __future__ import annotations

import torch

from foundry_fp8.swap import SwapConfig, convert_to_fp8
from tests.test_swap_convert import Net


def test_an_optimizer_built_before_conversion_trains_the_te_layers(fake_te):
    fake_te()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_to_fp8(model, SwapConfig(backend="te"))
    up = model.blocks[0].up
    assert all(any(p is q for q in optimizer.param_groups[0]["params"])
               for p in up.parameters()), "the optimizer does not hold the TE layer's parameters"
    before = up.weight.detach().clone()
    model(torch.randn(8, 32)).pow(2).sum().backward()
    optimizer.step()
    assert not torch.equal(up.weight.detach(), before), "the TE layer's weight did not train"
