"""docs/emulation.md's first example, run as written (its `linear` and `x` given): its comment
said `from_linear` kept the "same parameters", but it builds new Parameters with the values
copied, so an optimizer built on the old layer never trained the new one. The comment and
the code now agree on which it is, and the te_swap path keeps the objects as the page says."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from foundry_fp8 import SwapConfig, convert_to_fp8

DOC = Path(__file__).resolve().parents[1] / "docs" / "emulation.md"


def test_the_first_example_runs_and_says_what_from_linear_does_with_the_parameters() -> None:
    [code] = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)[:1]
    linear = nn.Linear(32, 16)
    scope = {"linear": linear, "x": torch.randn(8, 32)}
    exec(compile(code, str(DOC), "exec"), scope)  # noqa: S102 - the doc's own example
    layer = scope["layer"]
    assert torch.equal(layer.weight, linear.weight) and torch.equal(layer.bias, linear.bias)
    assert layer.weight.grad is not None  # the example's backward reached the new layer
    [comment] = [line.split("#", 1)[1] for line in code.splitlines() if "from_linear(" in line]
    said_new = "new Parameters" in comment
    assert said_new == (layer.weight is not linear.weight)


def test_convert_to_fp8_keeps_the_parameter_objects_as_the_page_says() -> None:
    assert "keeps their\nParameter objects" in DOC.read_text()
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(16, 16)])  # te_swap converts inside `blocks.<n>`
    weight = model.blocks[0].weight
    convert_to_fp8(model, SwapConfig(backend="emulate"))
    assert type(model.blocks[0]).__name__ == "EmulatedFP8Linear"
    assert model.blocks[0].weight is weight
