"""NaN/Inf advice and naming (QA Q4, s22). fp8_guard's NaN/Inf line names the layers in the
order the step cast their tensors (`health.rules.cast_place`, as fp8_stats' warning does), so
the layer a NaN began in comes first; it named them by name. The `nonfinite` rule advised
"lower clipping_threshold" for a gradient, which cannot remove a NaN: checked here against
torch's and Composer's own clipping."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from foundry_fp8.guard import nonfinite_message, nonfinite_rows
from foundry_fp8.health import HealthTracker
from foundry_fp8.health.rules import NONFINITE_CHANGE, NOT_CLIPPED

#: the tiny MPT's layers, forward order (LLM-Foundry's MPT block), as fp8_stats' rows give them
LAYERS = [f"blocks.{b}.{layer}" for b in (0, 1)
          for layer in ("attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj")]


def _table(nan: dict[tuple[str, str], float]) -> dict[tuple[str, str], dict[str, float]]:
    return {(layer, tensor): {"nan_count": nan.get((layer, tensor), 0.0), "amax": 1.0}
            for layer in LAYERS for tensor in ("activation", "weight", "gradient")}


def test_the_guard_names_the_layer_a_nan_began_in_first():
    # NaN put into the last layer's dY (Q1's fault) reaches every earlier dY in that backward
    rows = nonfinite_rows(_table({(layer, "gradient"): 3.0 for layer in LAYERS}))
    assert rows == [(layer, "gradient") for layer in reversed(LAYERS)]
    said = nonfinite_message(6, rows)
    assert f"(here {', '.join(LAYERS[:-5:-1])} and 4 more;" in said
    # a weight spoiled by an update: its own forward first, then the gradients before it
    rows = nonfinite_rows(_table({("blocks.1.ffn.up_proj", "weight"): 1.0,
                                  ("blocks.1.ffn.up_proj", "activation"): 0.0,
                                  ("blocks.1.ffn.down_proj", "activation"): 2.0,
                                  ("blocks.0.attn.Wqkv", "gradient"): 2.0}))
    assert rows == [("blocks.1.ffn.up_proj", "weight"), ("blocks.1.ffn.down_proj", "activation"),
                    ("blocks.0.attn.Wqkv", "gradient")]
    assert "in their high-precision weight, activation, gradient," in nonfinite_message(6, rows)


def _grads(bad: float) -> nn.Module:
    """A two-layer model after a backward, one element of its first gradient `bad`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    model[0].weight.grad[0, 0] = bad
    return model


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gradient_clipping_removes_no_nan_so_the_advice_is_the_learning_rate(bad):
    from composer.algorithms.gradient_clipping.gradient_clipping import apply_gradient_clipping

    model = _grads(bad)
    apply_gradient_clipping(model, "norm", 0.01, fsdp_enabled=False)  # Composer's, any threshold
    grads = [p.grad for p in model.parameters()]
    assert torch.isnan(grads[0][0, 0])  # a NaN stays, an Inf becomes NaN (inf * 0)
    # a NaN norm spreads to every gradient; an Inf one zeroes the rest: no step learns from them
    assert all((torch.isnan(g).all() if bad != bad else (g.nan_to_num() == 0).all())
               for g in grads)
    raised = HealthTracker().update(6, {("blocks.1.ffn.down_proj", "gradient"): {
        "nan_count" if bad != bad else "inf_count": 1.0}})
    [flag] = raised[("blocks.1.ffn.down_proj", "gradient")]
    assert "clipping_threshold" not in flag.yaml_key and flag.yaml_key.startswith("optimizer.lr")
    assert "gradient clipping cannot remove them" in flag.cause
    said = nonfinite_message(6, [("blocks.1.ffn.down_proj", "gradient")])
    assert "gradient clipping cannot remove them" in said and "change optimizer.lr (lower" in said


def test_the_guard_names_clipping_only_for_a_gradient_as_the_rule_does():
    """QA F2 s22: the guard's line said clipping cannot remove NaN/Inf held only by activations
    and weights, which clipping never touches; the rule says it for backward tensors only."""
    forward = [("blocks.0.attn.Wqkv", "activation"), ("blocks.1.ffn.up_proj", "weight")]
    rule = HealthTracker().update(6, {key: {"nan_count": 1.0} for key in forward})
    assert not any(NOT_CLIPPED in flag.cause for flags in rule.values() for flag in flags)
    assert NOT_CLIPPED not in nonfinite_message(6, forward)
    assert nonfinite_message(6, forward).endswith(f"change {NONFINITE_CHANGE}")
    assert NOT_CLIPPED in nonfinite_message(6, [*forward, ("blocks.0.attn.Wqkv", "gradient")])
