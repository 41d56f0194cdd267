"""The emulated layer's delayed-scaling state through edge-case inputs (+Inf, denormal-only,
all-zero), for each recipe option TE's `DelayedScaling` has (`max`/`most_recent`, margin,
HYBRID/E4M3, a history of 1), against a plain-Python model of TE's fused update kernel
written from transformer_engine/common/recipe/delayed_scaling.cu (TE 2.20.0.dev0, `kernel_bulk`
l. 162-253, `scaled_max` l. 331), not from `numerics.delayed_scale_update`."""

from __future__ import annotations

import math

import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe
from tests.test_numerics import f32

FLOAT32_MAX = torch.finfo(torch.float32).max
FP8_MAX = {"E4M3": 448.0, "E5M2": 57344.0}


def fmax(a: float, b: float) -> float:
    """C's fmaxf: a NaN operand yields the other."""
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return max(a, b)


def te_update(history: list[float], scale: float, fp8_max: float, algo: str,
              margin: int) -> tuple[list[float], float]:
    """One column of `kernel_bulk`: a zero row 0 leaves history and scale alone (l. 186);
    else the window's amax is fmaxf over rows 1.. and row 0 (l. 187-198), the history
    rolls to [0, rows 2.., row 0] (l. 196), and the scale is `scaled_max / amax` for a finite
    positive amax (l. 238-242), float32 max where that overflows (l. 247-249)."""
    last = history[0]
    if last == 0.0:
        return history, scale
    window = [*history[1:], last]
    amax = 0.0
    for a in window:
        amax = fmax(amax, a)
    if algo == "most_recent":
        amax = last
    new_history = [0.0, *window[1:]] if len(history) > 1 else [0.0]
    scaled_max = f32(fp8_max * 2.0 ** -margin)  # l. 331, float32
    if math.isfinite(amax) and amax > 0:
        scale = f32(scaled_max / amax)
    if math.isinf(scale):
        scale = FLOAT32_MAX
    return new_history, scale


def te_amax(t: torch.Tensor) -> float:
    """fmaxf over |t|: NaN skipped, Inf kept."""
    a = t.detach().float().abs()
    return torch.where(torch.isnan(a), 0.0, a).max().item()


#: (input, gradient multiplier) per step: +Inf in the input, a denormal-only input (its scale
#: overflows float32), an all-zero one (nothing recorded), and gradients likewise
STEPS = [(2.0, 1.0), ("inf", 2.5), (0.5, 1e-40), (1e-41, 0.0), (0.0, 3.0), (3.0, 1.0),
         (1.0, 1.0), (0.25, 0.5)]


def _input(step: int, how: float | str) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    if how == "inf":
        x[1, 2] = math.inf
        return x
    return x * how


@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 3])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_state_through_inf_denormal_and_zero_inputs_is_tes(fmt, algo, length, margin):
    recipe = FP8Recipe(fp8_format=fmt, amax_compute_algo=algo, amax_history_len=length,
                       margin=margin)
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(8, 4, bias=False)
    bwd_max = FP8_MAX["E5M2" if fmt == "HYBRID" else "E4M3"]
    ref = {"x": ([0.0] * length, 1.0), "w": ([0.0] * length, 1.0), "g": ([0.0] * length, 1.0)}
    for step, (how, grad_scale) in enumerate(STEPS):
        x = _input(step, how)
        with fp8_autocast(recipe=recipe):
            out = layer(x)
        (out * grad_scale).sum().backward()
        recorded = {"x": te_amax(x), "w": te_amax(layer.weight),
                    "g": te_amax(torch.full_like(out, grad_scale))}
        for key, fp8_max in (("x", 448.0), ("w", 448.0), ("g", bwd_max)):
            history, scale = ref[key]
            history = [fmax(history[0], recorded[key]), *history[1:]]
            ref[key] = te_update(history, scale, fp8_max, algo, margin)
        fwd, bwd = layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"]
        got = {"x": (fwd.amax_history[:, 0].tolist(), fwd.scale[0].item()),
               "w": (fwd.amax_history[:, 1].tolist(), fwd.scale[1].item()),
               "g": (bwd.amax_history[:, 0].tolist(), bwd.scale[0].item())}
        assert got == ref, (step, how)
        if how == 1e-41 and (algo == "most_recent" or length == 1):
            assert got["x"][1] == FLOAT32_MAX  # 448 / a denormal amax overflows float32
