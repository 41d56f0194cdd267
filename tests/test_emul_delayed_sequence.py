"""An emulated layer's forward scale through a sequence of steps whose input holds NaN, zeros
and Inf, in float16, bfloat16 and float32, against TE's fused delayed-scaling update as its
kernel is written (transformer_engine/common/recipe/delayed_scaling.cu, `kernel_bulk`,
release_v2.19 l. 176-249): the cast records the amax with fmaxf (NaN skipped, Inf kept); a
recorded 0 leaves history and scale alone; otherwise the history rolls, the amax is the window's
largest (`max`) or the recorded one (`most_recent`), and the scale becomes
`fp8_max * 2**-margin / amax` in float32 where that amax is finite and positive, else it is
kept. The reference below is that rule over a plain Python list of recorded amaxes."""

from __future__ import annotations

import math

import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe

#: per step, the input's largest finite magnitude and what else it holds
STEPS = [(3.0, None), (2.5, "nan"), (0.0, None), (5.0, None), (1.0, "inf"), (1.0, None),
         (2.0, None), (0.75, None)]


def _input(dtype: torch.dtype, top: float, extra: str | None) -> torch.Tensor:
    x = torch.zeros(4, 16, dtype=dtype)
    if top:
        x[0, 0], x[1, 1] = 0.5 * top, -top
    if extra:
        x[2, 2] = float(extra)
    return x


def _te_scales(algo: str, length: int, margin: int) -> list[float]:
    scale, window, scales = 1.0, [], []
    for top, extra in STEPS:
        recorded = math.inf if extra == "inf" else top  # fmaxf: NaN skipped, Inf kept
        if recorded != 0:
            window = (window + [recorded])[-length:]
            amax = recorded if algo == "most_recent" else max(window)
            if math.isfinite(amax) and amax > 0:
                scale = (torch.tensor(448.0 * 2.0 ** -margin) / torch.tensor(amax)).item()
        scales.append(scale)
    return scales


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("algo", "length", "margin", "fmt"), [
    ("most_recent", 1, 2, "E4M3"), ("max", 1, 0, "HYBRID"), ("max", 3, 1, "HYBRID"),
    ("most_recent", 4, 0, "HYBRID"),
])
def test_the_forward_scale_follows_te_s_update(dtype, algo, length, margin, fmt):
    recipe = FP8Recipe(amax_compute_algo=algo, amax_history_len=length, margin=margin,
                       fp8_format=fmt)
    layer = EmulatedFP8Linear(16, 8, dtype=dtype)
    got = []
    for top, extra in STEPS:
        x = _input(dtype, top, extra).requires_grad_(True)
        with fp8_autocast(recipe=recipe):
            y = layer(x)
        y.float().nan_to_num().sum().backward()
        got.append(layer.fp8_meta["scaling_fwd"].scale[0].item())
    assert got == _te_scales(algo, length, margin)
