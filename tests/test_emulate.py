"""EmulatedFP8Linear against an independent replay built from the numerics primitives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.numerics import FP8_MAX, quantize_dequantize
from foundry_fp8.recipe import FP8Recipe


def _replay_scales(amaxes: list[float], fmt: str, history_len: int, algo: str) -> list[float]:
    """Scale in force at each step, by hand: history of the last `history_len` amaxes."""
    scales, history, scale = [], [], 1.0
    for amax in amaxes:
        scales.append(scale)
        history = ([amax] + history)[:history_len]
        ref = max(history) if algo == "max" else history[0]
        scale = FP8_MAX[fmt] / ref if ref > 0 else scale
    return scales


def test_copy_is_exact_and_plain_outside_autocast():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    emulated = EmulatedFP8Linear.from_linear(linear)
    assert torch.equal(emulated.weight, linear.weight) and torch.equal(emulated.bias, linear.bias)
    assert set(dict(emulated.named_parameters())) == {"weight", "bias"}
    assert set(emulated.state_dict()) == {"weight", "bias"}  # FP8 state is fp8_state's job
    x = torch.randn(4, 16)
    assert torch.equal(emulated(x), linear(x))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_follows_recipe_and_replay(algo):
    torch.manual_seed(0)
    recipe = FP8Recipe(amax_history_len=3, amax_compute_algo=algo)
    layer = EmulatedFP8Linear(16, 8)
    inputs = [torch.randn(4, 16) * s for s in (1.0, 50.0, 2.0, 0.5, 0.1)]
    x_amaxes = [float(x.abs().max()) for x in inputs]
    g_amaxes = []
    want_x_scales = _replay_scales(x_amaxes, "e4m3", 3, algo)
    for step, x in enumerate(inputs):
        x = x.clone().requires_grad_()
        sx, sw = layer.fp8_meta["scaling_fwd"].scale[:2].tolist()  # scales in force
        assert sx == pytest.approx(want_x_scales[step], rel=1e-6)
        with fp8_autocast(recipe=recipe):
            out = layer(x)
        want_out = nn.functional.linear(quantize_dequantize(x.detach(), sx, "e4m3"),
                                        quantize_dequantize(layer.weight.detach(), sw, "e4m3"),
                                        layer.bias)
        assert torch.equal(out, want_out)
        grad = torch.randn_like(out) * (step + 1)
        g_amaxes.append(float(grad.abs().max()))
        out.backward(grad)
    assert layer.fp8_meta["scaling_fwd"].amax_history.shape == (3, 3)
    # the backward scale after the last step, replayed by hand over the gradient amaxes
    next_g_scale = _replay_scales(g_amaxes + [0.0], "e5m2", 3, algo)[-1]
    assert layer.fp8_meta["scaling_bwd"].scale[0].item() == pytest.approx(next_g_scale, rel=1e-6)


def test_current_scaling_keeps_no_history_and_saturates_nothing():
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(16, 8)
    x = torch.randn(4, 16) * 1000
    with fp8_autocast(recipe=FP8Recipe(scaling="current")):
        out = layer(x)
    assert layer.fp8_meta["scaling_fwd"].amax_history.abs().sum() == 0
    sx = FP8_MAX["e4m3"] / x.abs().max()
    sw = FP8_MAX["e4m3"] / layer.weight.detach().abs().max()
    want = nn.functional.linear(quantize_dequantize(x, sx, "e4m3"),
                                quantize_dequantize(layer.weight.detach(), sw, "e4m3"), layer.bias)
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-5)
