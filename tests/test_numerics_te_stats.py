"""Our statistics against TE's debug-API definitions, written here from TE's source.

TE's own functions (transformer_engine/debug/features/utils/stats_computation.py) import
`transformer_engine.pytorch`, which needs TE's compiled library: they cannot run on a CPU
machine without TE. So each formula below is re-implemented from that file (TE 2.20.0.dev0,
commit d0067d0; lines cited), over an FP8 cast written from the format's definition
(`tests.test_numerics.ref_round`), not from our code. Checked once by hand against TE's real
module loaded with a stub `DType` (no test can depend on that): the same numbers.

Where our definition deliberately differs from TE's, the test asserts the exact relation
between the two (docs/emulation.md, "Statistics and TE's debug API").
"""

from __future__ import annotations

import math

import pytest
import torch

from foundry_fp8.numerics import FP8_MAX, STAT_KEYS, finalize_stats, sufficient_stats, tensor_stats
from tests.test_numerics import f32, ref_round

NAN, INF = float("nan"), float("inf")
FLOAT32_MAX = torch.finfo(torch.float32).max


def te_amax(values: list[float]) -> float:
    """The amax TE's cast kernels record: fmaxf over |x|, NaN skipped, Inf kept
    (common/recipe/current_scaling.cu:44-69)."""
    return max((abs(v) for v in values if not math.isnan(v)), default=0.0)


def te_current_scale(amax: float, fmt: str) -> float:
    """`compute_scale_from_amax` (common/recipe/recipe_common.cuh:14-49), epsilon 0, no
    power of 2: 1 for a zero, Inf or NaN amax, float32 max where the quotient overflows."""
    if amax == 0 or math.isinf(amax) or math.isnan(amax):
        return 1.0
    scale = f32(FP8_MAX[fmt] / f32(amax))  # float64 quotient of float32s, rounded once
    return FLOAT32_MAX if math.isinf(scale) else scale


def te_cast(values: list[float], fmt: str, scale: float) -> list[float]:
    """TE's saturating cast: `x * scale` in float32, to FP8 (NaN stays NaN)."""
    return [v if math.isnan(v) else ref_round(f32(v * scale), fmt) for v in values]


def te_stats(x: torch.Tensor, fmt: str, scale: float) -> dict[str, float]:
    """TE's LogFp8TensorStats statistics of x cast at `scale`, from stats_computation.py."""
    values = x.float().tolist()
    q = te_cast(values, fmt, scale)
    scale_inv = f32(1.0 / scale)  # the `_scale_inv` TE's cast writes
    n = len(values)
    # underflows: x.count_nonzero() - count_nonzero_fp8(data), over numel (l. 290-331); NaN is
    # nonzero in both, an Inf saturates to a nonzero
    underflows = sum(1 for v in values if v != 0) - sum(1 for v in q if v != 0)
    # overflows: x beyond fp8_max * scale_inv, compared in float32 (l. 138-158, 265-274)
    limit = f32(FP8_MAX[fmt] * scale_inv)
    overflows = sum(1 for v in values if v > limit or v < -limit)
    # mse: F.mse_loss(x, dequantize()), dequantize = q * scale_inv in x's dtype (l. 395-418);
    # summed here in float64 (TE's float32 sum is its own rounding)
    round_trip = torch.tensor([f32(v * scale_inv) for v in q], dtype=torch.float64)
    dequantized = round_trip.float().to(x.dtype).double().tolist()
    mse = sum((a - b) ** 2 for a, b in zip(x.double().tolist(), dequantized, strict=True)) / n
    return {"underflows%": 100.0 * underflows / n, "overflows%": 100.0 * overflows / n,
            "overflows_num": overflows, "mse": mse, "scale_inv": scale_inv,
            "cur_amax": x.abs().max().item(),  # l. 239: torch's max, NaN propagates
            "rt_rms": round_trip.square().mean().sqrt().item()}


def _heavy(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, generator=gen) / torch.randn(n, generator=gen).abs().clamp_min(1e-3)


def _inputs() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    normal = torch.randn(1024, generator=gen)
    return [("normal", normal), ("heavy", _heavy(1024, gen)),
            ("wide", torch.randn(1024, generator=gen) * torch.logspace(-12, 4, 1024)),
            ("small", normal * 1e-3), ("zeros", torch.zeros(64))]


CASES = [(name, x.to(dtype), fmt, scale)
         for name, x in _inputs() for dtype in (torch.float32, torch.bfloat16)
         for fmt in ("e4m3", "e5m2") for scale in (None, 1.0, 3.0e4, 0.37)]


@pytest.mark.parametrize(("name", "x", "fmt", "scale"), CASES,
                         ids=[f"{c[0]}-{str(c[1].dtype)[6:]}-{c[2]}-{c[3]}" for c in CASES])
def test_finite_tensors_agree_with_tes_debug_statistics(name, x, fmt, scale):
    values = x.float().tolist()
    used = te_current_scale(te_amax(values), fmt) if scale is None else f32(scale)
    te = te_stats(x, fmt, used)
    ours = tensor_stats(x, fmt, scale=scale)
    assert ours["underflow_pct"] == te["underflows%"]
    assert f32(1.0 / ours["scale"]) == te["scale_inv"]  # TE's scale_inv_min/max (l. 337-389)
    assert ours["amax"] == te["cur_amax"]
    if scale is not None:  # TE defines overflows% for delayed scaling only
        assert ours["overflow_pct"] == te["overflows%"]  # log_fp8_tensor_stats.py:119, 210
    else:  # a cast at the tensor's own amax clips nothing beyond the rounding to fp8_max
        assert ours["overflow_pct"] == 0.0
    if x.dtype == torch.float32:
        assert ours["mse"] == pytest.approx(te["mse"], rel=1e-6, abs=1e-300)
    elif x.dtype == torch.bfloat16:
        # TE's mse compares x with the round trip rounded to bfloat16 (dequantize() returns
        # x's dtype); ours with the float32 round trip r the FP8 GEMM multiplies. Their root
        # mean squares differ by at most that rounding's, 2**-9 * rms(r) (triangle inequality),
        # plus our float32 sums' rounding
        gap = abs(math.sqrt(ours["mse"]) - math.sqrt(te["mse"]))
        assert gap <= 2.0 ** -9 * te["rt_rms"] + 1e-6 * math.sqrt(te["mse"])


def test_mse_of_tiny_magnitudes_is_not_flushed_as_tes_float32_sum_is():
    """TE's mse squares float32 errors (F.mse_loss): errors of 1e-32 square to 0 in float32.
    Ours rescales by powers of 2 first, so the number is the true mean square (1e-64 order)."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(3)) * 1e-30
    te_float32 = torch.nn.functional.mse_loss(
        x, torch.tensor(te_cast(x.tolist(), "e4m3", te_current_scale(te_amax(x.tolist()), "e4m3")))
        * f32(1.0 / te_current_scale(te_amax(x.tolist()), "e4m3"))).item()
    assert te_float32 == 0.0
    ours = tensor_stats(x, "e4m3")["mse"]
    want = te_stats(x, "e4m3", te_current_scale(te_amax(x.tolist()), "e4m3"))["mse"]  # float64
    assert ours == pytest.approx(want, rel=1e-6) and ours > 0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_largest_element_at_its_own_delayed_scale_overflows_as_te_counts_it(fmt, dtype):
    """A tensor whose amax is the amax its delayed scale came from (an unchanged weight):
    `amax * scale` lands on either side of fp8_max by rounding. TE counts an overflow where
    `amax > fp8_max * scale_inv`; ours counted `amax * scale > fp8_max`, which disagreed for
    65-72 of these 500 amaxes (13-14 %)."""
    gen = torch.Generator().manual_seed(7)
    amaxes = torch.exp(torch.randn(500, generator=gen) * 5).to(dtype).float().tolist()
    for a in amaxes:
        scale = te_current_scale(a, fmt)  # the delayed update's quotient (same rounding)
        x = torch.tensor([a, -a / 3, a / 1000]).to(dtype)
        assert tensor_stats(x, fmt, scale=scale)["overflow_pct"] == (
            te_stats(x, fmt, scale)["overflows%"]), a


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [None, 7.0])
def test_nan_and_inf_differ_from_te_exactly_as_documented(fmt, scale):
    """TE's percentages divide by every element, its overflows count an Inf, its mse and
    cur_amax are NaN where a NaN is; ours leave NaN/Inf out of every statistic but the counts.
    The relation is exact."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1000, generator=gen) * 4
    x[[3, 50]], x[[7, 8, 9]] = NAN, torch.tensor([INF, -INF, INF])
    values = x.tolist()
    used = te_current_scale(te_amax(values), fmt) if scale is None else scale
    assert scale is not None or used == 1.0  # an Inf: TE's amax is Inf, its scale 1
    te = te_stats(x, fmt, used)
    finite = x[torch.isfinite(x)]
    te_finite = te_stats(finite, fmt, used)
    ours = tensor_stats(x, fmt, scale=scale)
    n, n_finite = x.numel(), finite.numel()
    assert ours["nan_count"] == 2 and ours["inf_count"] == 3
    assert ours["underflow_pct"] * n_finite / n == pytest.approx(te["underflows%"], rel=1e-12)
    assert ours["overflow_pct"] * n_finite / 100 + 3 == te["overflows_num"]
    assert math.isnan(te["mse"]) and math.isnan(te["cur_amax"])
    assert ours["mse"] == pytest.approx(te_finite["mse"], rel=1e-6)
    assert ours["amax"] == te_finite["cur_amax"]
    assert f32(1.0 / ours["scale"]) == te["scale_inv"]


def _pool(rows: torch.Tensor) -> torch.Tensor:
    return finalize_stats(torch.cat([rows[:, :10].sum(0), rows[:, 10:].amax(0)]))


@pytest.mark.parametrize("other", [torch.zeros(0), torch.zeros(40), torch.full((4,), NAN)])
def test_a_piece_with_nothing_to_scale_leaves_the_pooled_scale_to_the_others(other):
    """Current scaling pools each piece's own scale (the smallest). A piece with no nonzero
    finite element (an empty shard: TE does not cast it; all zeros or NaN: amax 0, scale 1)
    made the pooled scale 1 and scale_ratio 1/fp8_max-ish for a tensor cast at 448 / amax."""
    x = torch.randn(300, generator=torch.Generator().manual_seed(2)) * 1e-2
    rows = torch.stack([sufficient_stats(x, "e4m3"), sufficient_stats(other, "e4m3")])
    pooled = dict(zip(STAT_KEYS, _pool(rows).tolist(), strict=True))
    want = te_current_scale(te_amax(x.tolist()), "e4m3")
    assert pooled["scale"] == want and pooled["scale_ratio"] == 1.0
    alone = tensor_stats(other, "e4m3")  # nothing to scale anywhere: TE's 1
    assert alone["scale"] == 1.0
