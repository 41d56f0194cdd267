"""mse and cos_sim of tensors whose round trip is exact but for elements far below the amax,
against TE's definition (`tests.test_numerics_te_stats.te_stats`, written from TE's
stats_computation.py: `F.mse_loss(x, dequantize())`).

Our sums are taken at a power-of-2 rescaling of x. With the amax rescaled to near fp8_max, an
error below 2**-72 of the amax squared to 0 in float32: [3.4e38, 1.0] read mse 0 (an exact
round trip, beside 50 % underflow) where TE's own float32 mse_loss gives 0.5.
"""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.numerics import FP8_MAX, tensor_stats
from tests.test_numerics_te_stats import te_amax, te_current_scale, te_stats

FLOAT32_MAX = torch.finfo(torch.float32).max


def _te_float32_mse(x: torch.Tensor, fmt: str, scale: float) -> float:
    """TE's mse as its float32 `F.mse_loss` computes it (stats_computation.py:407-408)."""
    scale_t = torch.tensor(scale, dtype=torch.float32)
    q = (x * scale_t).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(
        {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt])
    return torch.nn.functional.mse_loss(x, q.float() * (1.0 / scale_t)).item()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize(("x", "scale"), [
    # current scaling: the amax lands on fp8_max exactly, the 1.0 underflows
    ([FLOAT32_MAX, 1.0], None),
    # a power-of-2 (delayed) scale: 2**60 casts to 256 exactly, 1e-10 underflows
    ([2.0 ** 60, -1e-10, 2.0 ** 58], 2.0 ** -52),
])
def test_the_error_of_elements_far_below_an_exact_amax_is_counted(fmt, x, scale):
    x = torch.tensor(x)
    used = te_current_scale(te_amax(x.tolist()), fmt) if scale is None else scale
    te = te_stats(x, fmt, used)
    ours = tensor_stats(x, fmt, scale=scale)
    assert te["mse"] > 0 and _te_float32_mse(x, fmt, used) == pytest.approx(te["mse"], rel=1e-6)
    assert ours["underflow_pct"] == te["underflows%"] > 0
    assert ours["mse"] == pytest.approx(te["mse"], rel=1e-6)  # was 0
    assert 0 < ours["rel_mse"] < 1e-30 and ours["cos_sim"] == pytest.approx(1.0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("value", [FLOAT32_MAX, 3.0, 1e-30])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_full_rows_at_the_amax_do_not_overflow_the_working_sums(fmt, value, scale):
    """Every element at the amax, 3 rows of 1024 and a part: the largest float32 sums there
    are. A working magnitude too close to float32's top made them Inf (cos_sim NaN)."""
    x = torch.full((3 * 1024 + 5,), value)
    x[::2] *= -1
    used = te_current_scale(te_amax(x.tolist()), fmt) if scale is None else scale
    te = te_stats(x, fmt, used)
    ours = tensor_stats(x, fmt, scale=scale)
    assert ours["mse"] == pytest.approx(te["mse"], rel=1e-6, abs=1e-300)
    if te["rt_rms"] > 0:  # else nothing survives the cast: cos_sim 0
        assert ours["cos_sim"] == pytest.approx(1.0, abs=1e-2)
    assert 0 <= ours["rel_mse"] <= 1.0
