"""FP8 numerics against an independent float64 reference written from the format definitions."""

from __future__ import annotations

import math
import random
import struct

import pytest
import torch

from foundry_fp8 import numerics
from foundry_fp8.numerics import (
    FP8_MAX,
    STAT_KEYS,
    SUM_KEYS,
    amax,
    current_scale,
    delayed_scale_update,
    empty_sufficient_stats,
    finalize_stats,
    quantize_dequantize,
    sufficient_stats,
    tensor_stats,
    tensor_stats_tensor,
)

# (mantissa bits, smallest normal exponent) of each format
FORMAT_BITS = {"e4m3": (3, -6), "e5m2": (2, -14)}
NAN, INF = float("nan"), float("inf")

#: The statistics made of sums of squares: float32 partial sums added in float64, so the pieces
#: of a tensor pooled and the whole tensor agree to float32 rounding; the counts and maxima the
#: others are made of pool exactly.
SUMMED = ("mse", "rel_mse", "cos_sim")


def pooled_rel(key: str) -> float:
    """How closely a statistic pooled from pieces equals the whole tensor's."""
    return 1e-6 if key in SUMMED else 1e-12


@pytest.fixture(params=["whole", "pieces"])
def pieces(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways `sufficient_stats` reads a tensor: whole, and as a tensor larger than
    numerics.CHUNK, in pieces (here of 5 elements, summed in rows of 2: the last one padded)."""
    if request.param == "pieces":
        monkeypatch.setattr(numerics, "CHUNK", 5)
        monkeypatch.setattr(numerics, "ROW", 2)


def f32(v: float) -> float:
    """v rounded to float32, to nearest even (beyond float32's range: inf), as C's cast."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def ref_round(v: float, fmt: str) -> float:
    """Round-to-nearest-even onto the FP8 grid, saturating at the format max (pure Python)."""
    mbits, emin = FORMAT_BITS[fmt]
    if v == 0:
        return 0.0
    if math.isinf(v):
        return math.copysign(FP8_MAX[fmt], v)
    e = max(math.floor(math.log2(abs(v))), emin)
    step = 2.0 ** (e - mbits)
    q = round(v / step) * step  # Python's round is half-to-even
    return max(-FP8_MAX[fmt], min(FP8_MAX[fmt], q))


def ref_round_trip(v: float, fmt: str, scale: float) -> float:
    """The float32 value TE's round trip gives: `x * scale` in float32, cast to FP8, times
    `scale_inv = float32(1 / scale)` in float32 (TE's cast, dequantize_fp8.cuh:31-32 and
    utils.cuh:949-951). The float64 products of float32 numbers are exact and so is the
    reciprocal rounded twice (53 >= 2 * 24 + 2 bits), so each f32 is one rounding."""
    scale = f32(scale)
    return f32(ref_round(f32(v * scale), fmt) * f32(1.0 / scale))


def ref_stats(values: list[float], fmt: str, scale: float) -> dict[str, float]:
    finite = [v for v in values if math.isfinite(v)]
    rt = [ref_round_trip(v, fmt, scale) for v in finite]
    n = len(finite)
    dot = sum(a * b for a, b in zip(finite, rt, strict=True))
    na, nb = math.sqrt(sum(a * a for a in finite)), math.sqrt(sum(b * b for b in rt))
    return {
        "amax": max(abs(v) for v in finite),
        "amin": min(abs(v) for v in finite if v != 0),
        "underflow_pct": 100.0 * sum(1 for v, r in zip(finite, rt, strict=True) if v != 0 and r == 0) / n,
        # TE's overflow test, `|x| > fp8_max * scale_inv` in float32
        # (transformer_engine/debug/features/utils/stats_computation.py:157)
        "overflow_pct": 100.0 * sum(1 for v in finite
                                    if abs(v) > f32(FP8_MAX[fmt] * f32(1.0 / f32(scale)))) / n,
        "mse": sum((a - b) ** 2 for a, b in zip(finite, rt, strict=True)) / n,
        "rel_mse": sum((a - b) ** 2 for a, b in zip(finite, rt, strict=True)) / (na * na),
        "cos_sim": dot / (na * nb),
    }


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_round_trip_matches_reference_grid(fmt):
    rng = random.Random(0)
    values = [rng.gauss(0, 1) * 10 ** rng.uniform(-4, 3) for _ in range(2000)]
    values += [FP8_MAX[fmt], FP8_MAX[fmt] * 1.01, -FP8_MAX[fmt] * 5, 2.0 ** -9, 2.0 ** -17]
    x = torch.tensor(values, dtype=torch.float32)
    got = quantize_dequantize(x, 1.0, fmt)
    want = torch.tensor([ref_round(float(v), fmt) for v in x], dtype=torch.float32)
    assert torch.equal(got, want)
    assert not torch.isnan(got).any(), "overflow must saturate, not become NaN"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_stats_match_float64_reference(fmt, dtype, pieces):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(4096, generator=gen) * torch.logspace(-9, 2, 4096)).to(dtype)
    scale = FP8_MAX[fmt] / 128.0  # exact in float32; a stale delayed-style scale: the largest elements overflow
    got = tensor_stats(x, fmt, scale=scale)
    want = ref_stats([float(v) for v in x.float()], fmt, scale)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-12), key
    assert got["overflow_pct"] > 0 and got["underflow_pct"] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_counts_are_exact_in_every_input_dtype(dtype, pieces):
    """NaN, Inf, underflow and overflow counts exact for a tensor read in its own dtype, with
    counts (2,997 finite elements) that bfloat16 cannot represent."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(3001, generator=gen) * torch.logspace(-6, 1, 3001)).to(dtype)
    x[::7] = 0.0
    x[5], x[11], x[13], x[17] = NAN, INF, -INF, NAN
    scale = 64.0  # a power of 2: x * scale is exact in every dtype; |x| > 7 overflows
    got = tensor_stats(x, "e4m3", scale=scale)
    want = ref_stats([float(v) for v in x.float()], "e4m3", scale)
    assert got["nan_count"] == 2 and got["inf_count"] == 2
    assert want["overflow_pct"] > 0 and want["underflow_pct"] > 0
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5 if key in SUMMED else 1e-12), key


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("magnitude, scale", [(1.0, 2.0 ** 100), (1e25, 1.0), (1e-30, 2.0 ** 100)])
def test_sums_stay_exact_whatever_the_scale(fmt, magnitude, scale, pieces):
    """A scale far from the tensor's range (a stale delayed scale 2**100 too large, so that
    everything saturates; values of 1e25 cast with the initial scale 1) keeps every sum of squares
    finite and exact: they are taken at a working scale near the tensor's own, where float32
    squares of |x| * scale would overflow."""
    x = torch.randn(2000, generator=torch.Generator().manual_seed(8)) * magnitude
    got = tensor_stats(x, fmt, scale=scale)
    want = ref_stats([float(v) for v in x], fmt, scale)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_a_tensor_below_the_fp8_range_underflows_whole(fmt, pieces):
    """Gradients of 1e-25 cast with the initial scale 1 all round to 0: the error is the whole
    tensor (rel_mse 1), not lost to float32 squares of 1e-25 underflowing to 0."""
    x = torch.randn(2000, generator=torch.Generator().manual_seed(9)) * 1e-25
    got = tensor_stats(x, fmt, scale=1.0)
    x64 = x.double()
    assert got["underflow_pct"] == 100.0
    assert got["mse"] == pytest.approx(float(x64.square().mean()), rel=1e-5)
    assert got["rel_mse"] == pytest.approx(1.0, rel=1e-6)
    assert got["cos_sim"] == 0.0  # nothing of x is left (it read 1.0, as for a zero tensor)


def test_current_scaling_fills_the_range_and_never_overflows(pieces):
    x = torch.tensor([0.5, -2.0, 1e-3, 0.0])
    stats = tensor_stats(x, "e4m3")
    assert stats["scale"] == pytest.approx(448.0 / 2.0)
    assert stats["overflow_pct"] == 0.0
    noisy = torch.randn(100_000, generator=torch.Generator().manual_seed(3)) * 7.3
    assert tensor_stats(noisy, "e4m3")["overflow_pct"] == 0.0
    assert stats["amin"] == pytest.approx(1e-3)
    # exactly fp8_max survives a unit-scale round trip; just above saturates to it
    assert tensor_stats(torch.tensor([448.0]), "e4m3", scale=1.0)["mse"] == 0.0
    above = tensor_stats(torch.tensor([480.0]), "e4m3", scale=1.0)
    assert above["overflow_pct"] == 100.0 and above["mse"] == pytest.approx(32.0 ** 2)


def test_nan_and_inf_are_counted_but_do_not_poison_stats(pieces):
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0, float("-inf")])
    stats = tensor_stats(x, "e4m3")
    assert stats["nan_count"] == 1 and stats["inf_count"] == 2
    assert stats["amax"] == 2.0 and stats["cos_sim"] == pytest.approx(1.0)
    assert all(math.isfinite(v) for v in stats.values())


def test_all_zero_tensor(pieces):
    stats = tensor_stats(torch.zeros(16), "e4m3")
    assert stats["amax"] == 0.0 and stats["scale"] == 1.0  # TE keeps scale 1 for amax 0
    assert stats["underflow_pct"] == 0.0 and stats["mse"] == 0.0
    assert stats["cos_sim"] == 1.0  # its round trip is exact


@pytest.mark.parametrize("value", [NAN, INF])
def test_a_tensor_with_no_finite_element_has_no_round_trip_stats(value, pieces):
    """All NaN (a diverged layer): no finite element to cast, so the round-trip statistics are
    NaN (skipped by the summaries and rules), not the perfect cos_sim 1.0 / 0 % they read; pooled
    with a rank that has finite elements, that rank's numbers stand."""
    got = tensor_stats(torch.full((6,), value), "e4m3", scale=2.0)
    assert got["nan_count" if value != INF else "inf_count"] == 6.0 and got["scale"] == 2.0
    for key in ("underflow_pct", "overflow_pct", "mse", "rel_mse", "cos_sim", "scale_ratio"):
        assert math.isnan(got[key]), key
    rows = torch.stack([sufficient_stats(torch.full((6,), value), "e4m3", 2.0),
                        sufficient_stats(torch.tensor([0.5, -1.0]), "e4m3", 2.0)])
    pooled = dict(zip(STAT_KEYS, finalize_stats(rows.sum(0).where(
        torch.arange(rows.shape[1]) < len(SUM_KEYS), rows.amax(0))).tolist(), strict=True))
    assert pooled["cos_sim"] == 1.0 and pooled["underflow_pct"] == 0.0  # 0.5, 1.0 exact


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_an_inf_makes_current_scaling_cast_at_scale_1_as_te(fmt, pieces):
    """TE's amax reduction takes an Inf in (fmaxf) and an infinite amax gives scale 1
    (transformer_engine/common/recipe/recipe_common.cuh:24-26): the finite rest is cast at scale
    1, saturating above fp8_max and flushing what is below half the smallest subnormal (the
    stats described a cast at fp8_max / finite amax, which never happened)."""
    values = [1e-3, -2e-3, 0.5, 2.0, 1e5, 3e-6, -7.25]
    got = tensor_stats(torch.tensor([*values, INF]), fmt)
    assert got["scale"] == 1.0 and got["inf_count"] == 1.0
    want = ref_stats(values, fmt, 1.0)
    assert want["overflow_pct"] > 0 and want["underflow_pct"] > 0  # both rules can see it
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key
    margin = tensor_stats_tensor(torch.tensor([*values, -INF]), fmt, None, margin=2)
    assert margin[STAT_KEYS.index("scale")].item() == 0.25
    # magnitudes whose float32 squares overflow or underflow at scale 1 (no working scale made
    # them read rel_mse 0 and cos_sim 1 for a tensor flushed whole)
    flushed = tensor_stats(torch.tensor([1e-25, -2e-25, 3e-26, INF]), fmt)
    assert flushed["underflow_pct"] == 100.0 and flushed["cos_sim"] == 0.0
    assert flushed["rel_mse"] == pytest.approx(1.0, rel=1e-6)
    big = [1e20, -5e19, 1.0]
    got, want = tensor_stats(torch.tensor([*big, INF]), fmt), ref_stats(big, fmt, 1.0)
    for key in ("rel_mse", "cos_sim", "overflow_pct", "underflow_pct"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key


def test_mse_is_the_error_of_the_round_trip_te_produces(pieces):
    """mse is `(x - q * float32(1 / scale))**2`, the round trip TE's GEMMs see (they multiply
    by scale_inv), not `(x * scale - q) / scale`, which leaves out scale_inv's rounding and the
    product's: an ulp of the round trip, all of the error where x * scale falls on the FP8 grid.
    By hand: 1e-3 * 1e4 rounds to 10, exact in E4M3, and 10 * float32(1e-4) is 2**-33 below
    float32(1e-3) (mse 2**-66, read 0 before); 0.3161 * 0.37 rounds to 15 * 2**-7, and
    15 * 2**-7 * float32(1 / 0.37) = float32 0.316722989..., an error of 3.881137e-07 squared
    (read 3.880906e-07)."""
    got = tensor_stats(torch.tensor([1e-3]), "e4m3", scale=1e4)
    assert got["mse"] == 2.0 ** -66
    got = tensor_stats(torch.tensor([0.3161]), "e4m3", scale=0.37)
    assert f32(15 * 2.0 ** -7 * f32(1 / f32(0.37))) == 0.3167229890823364
    assert got["mse"] == pytest.approx((f32(0.3161) - 0.3167229890823364) ** 2, rel=1e-7)
    assert got["mse"] == pytest.approx(3.881137e-07, rel=1e-6)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("magnitude", [1.0, 1e20, 1e-25])
@pytest.mark.parametrize("scale", ["current", "stale"])
def test_round_trip_stats_near_the_fp8_grid_match_te_to_float32_rounding(fmt, magnitude, scale,
                                                                           pieces):
    """Values whose x * scale lands next to an FP8 grid point, where the round trip's own
    rounding is most of the error: mse, rel_mse and cos_sim against the float64 sums of TE's
    float32 round trip, to float32 rounding, at magnitudes whose float32 squares would
    overflow (1e20) or underflow (1e-25), under current scaling and a stale scale 2**8 too
    large (the largest elements saturate). The scaled domain's `x * scale` rounding put mse
    0.7-3 % off here."""
    rng = random.Random(11)
    amax = f32(magnitude * 3.7)
    cast = FP8_MAX[fmt] / amax if scale == "current" else FP8_MAX[fmt] / amax * 2.0 ** 8
    grid = [ref_round(rng.uniform(-1, 1) * FP8_MAX[fmt], fmt) for _ in range(1500)]
    values = [f32(g / f32(cast) * (1 + rng.uniform(-1, 1) * 2.0 ** -22)) for g in grid]
    values = [v for v in values if 0 < abs(v) < amax] + [amax, -amax / 2]
    got = tensor_stats(torch.tensor(values), fmt, scale=None if scale == "current" else cast)
    want = ref_stats(values, fmt, f32(FP8_MAX[fmt] / amax) if scale == "current" else cast)
    assert got["scale"] == f32(FP8_MAX[fmt] / amax if scale == "current" else cast)
    for key in SUMMED:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=0), key
    assert 0 < want["mse"] and math.isfinite(want["mse"])


@pytest.mark.parametrize("values", [[1e-40, -3e-41, 1e-41, 7e-42], [3e38, -1e38, 2e37, 1.0]],
                         ids=["subnormal", "near-float32-max"])
def test_round_trip_stats_at_the_ends_of_float32(values, pieces):
    """Current scaling of float32 subnormals (the scale clamps to float32 max, its scale_inv is
    subnormal) and of values near float32 max: the round trip's statistics stay TE's. With the
    working power of 2 clamped for x but not for the round trip, the subnormal tensor read
    rel_mse 2.8e8 and cos_sim -16830."""
    got = tensor_stats(torch.tensor(values), "e4m3")
    want = ref_stats([f32(v) for v in values], "e4m3", got["scale"])
    for key in SUMMED:
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=0), key


def test_subnormal_underflow_hand_computed(pieces):
    # e4m3's smallest subnormal is 2**-9; half of it rounds (to even) to zero.
    x = torch.tensor([2.0 ** -9, 2.0 ** -10, 2.0 ** -11, 1.0])
    stats = tensor_stats(x, "e4m3", scale=1.0)
    assert stats["underflow_pct"] == pytest.approx(50.0)


def test_current_scale_edge_rules():
    amax = torch.tensor([2.0, 0.0, float("inf"), 1e-45])
    scale = current_scale(amax, "e4m3")
    assert scale.tolist()[:3] == [224.0, 1.0, 1.0]
    assert scale[3].item() == torch.finfo(torch.float32).max
    assert current_scale(torch.tensor(3.0), "e4m3", power_2=True).item() == 128.0
    assert current_scale(torch.tensor(1e-6), "e4m3", epsilon=1e-3).item() == pytest.approx(448e3)


def test_scales_are_quotients_rounded_once():
    """TE divides with one rounding (`__fdiv_rn`), which the float64 quotient rounded to float32
    is; power-of-2 scales keep the exponent bits, so a scale just below 2**20 gives 2**19."""
    amax = torch.rand(10_000, generator=torch.Generator().manual_seed(4)) * 10 + 1e-3
    assert torch.equal(current_scale(amax, "e4m3"), (448.0 / amax.double()).float())
    _, scale = delayed_scale_update(amax[None], torch.ones_like(amax), 448.0, "max", margin=1)
    assert torch.equal(scale, (224.0 / amax.double()).float())
    exact = torch.tensor(448.0 * 2.0 ** -20)
    above = torch.nextafter(exact, torch.tensor(1.0))
    assert current_scale(exact, "e4m3", power_2=True).item() == 2.0 ** 20
    assert current_scale(above, "e4m3").item() < 2.0 ** 20
    assert current_scale(above, "e4m3", power_2=True).item() == 2.0 ** 19



def test_dequantize_multiplies_by_the_float32_reciprocal_as_te():
    """TE dequantizes as `q * scale_inv` with `scale_inv = __frcp_rn(scale)`
    (common/cast/fp8/dequantize_fp8.cuh:31-32, common/utils.cuh:949-951): the reference is
    that product in numpy float32, one rounding each, which `q / scale` misses by an ulp."""
    import numpy as np

    scales = np.float32([5213.0908, 154.48, 3.3, 0.37, 1024.0])
    q = np.float32([160.0, -0.013671875, 448.0, 3.25])  # E4M3 values
    for scale in scales:
        reference = q * (np.float32(1.0) / scale)
        got = numerics.dequantize(torch.from_numpy(q).to(torch.float8_e4m3fn), float(scale))
        assert np.array_equal(got.numpy(), reference), scale
    quotient = np.float32(160.0) / scales[0]
    assert quotient != np.float32(160.0) * (np.float32(1.0) / scales[0])  # the case tells them apart
    assert numerics.dequantize(torch.tensor([160.0]).to(torch.float8_e4m3fn),
                               torch.tensor(5213.0908)).item() == pytest.approx(
        0.0306919664144516, rel=0, abs=1e-18)


def test_delayed_update_follows_the_fused_kernel_column_by_column():
    """Hand-computed, newest amax in row 0. Columns: 0 recorded 4: rolled, max(4, 8, 2) = 8;
    1 recorded nothing (older rows 3, 5): left alone, where always rolling would give 448/2/5;
    2 recorded NaN: rolled, the max skips it; 3 all zero: left alone; 4 recorded inf: rolled,
    scale kept."""
    history = torch.tensor([[4.0, 0.0, NAN, 0.0, INF],
                            [8.0, 3.0, 1.0, 0.0, 1.0],
                            [2.0, 5.0, 1.0, 0.0, 1.0]])
    scale = torch.tensor([1.0, 5.0, 7.0, 9.0, 11.0])
    want_history = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0],
                                 [2.0, 3.0, 1.0, 0.0, 1.0],
                                 [4.0, 5.0, NAN, 0.0, INF]])
    new_history, new_scale = delayed_scale_update(history, scale, 448.0, "max", margin=1)
    assert new_scale.tolist() == [448.0 / 2 / 8, 5.0, 448.0 / 2 / 1, 9.0, 11.0]
    torch.testing.assert_close(new_history, want_history, rtol=0, atol=0, equal_nan=True)
    new_history, new_scale = delayed_scale_update(history, scale, 448.0, "most_recent")
    assert new_scale.tolist() == [448.0 / 4, 5.0, 7.0, 9.0, 11.0]  # NaN, inf: scale kept
    torch.testing.assert_close(new_history, want_history, rtol=0, atol=0, equal_nan=True)


def test_delayed_update_divides_the_margin_scaled_max():
    """`fp8_max * 2**-margin / amax` as TE's kernel: for amax 9e-37, 448 / amax overflows float32
    but 224 / amax does not; a smaller amax still overflows to float32 max."""
    history = torch.tensor([[9e-37, 1e-45]])
    _, scale = delayed_scale_update(history, torch.ones(2), 448.0, "max", margin=1)
    assert 448.0 / float(history[0, 0]) > torch.finfo(torch.float32).max
    want = torch.tensor([224.0 / float(history[0, 0]), torch.finfo(torch.float32).max])
    assert torch.equal(scale, want)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_update_without_new_amaxes_changes_nothing(algo):
    history = torch.tensor([[3.0, 0.0], [1.0, 0.0], [6.0, 0.0]])
    state = delayed_scale_update(history, torch.tensor([1.0, 2.0]), 448.0, algo)
    once = [t.clone() for t in state]
    for _ in range(3):  # TE updates every registered module at every outermost exit
        state = delayed_scale_update(*state, 448.0, algo)
        assert all(torch.equal(a, b) for a, b in zip(state, once, strict=True))
    zeros, scale = torch.zeros(4, 3), torch.tensor([1.0, 2.0, 3.0])
    new_history, new_scale = delayed_scale_update(zeros, scale, 448.0, algo)
    assert torch.equal(new_history, zeros) and torch.equal(new_scale, scale)


def test_scale_ratio_and_current_scale_hand_computed(pieces):
    x = torch.tensor([0.5, -2.0, 1e-3])
    stats = tensor_stats(x, "e4m3", scale=56.0)  # a delayed scale from an older amax of 8
    assert stats["current_scale"] == 224.0 and stats["scale"] == 56.0
    assert stats["scale_ratio"] == 0.25  # a quarter of the range wasted
    assert tensor_stats(x, "e4m3")["scale_ratio"] == 1.0  # current scaling
    assert tensor_stats(x, "e4m3", margin=1)["scale_ratio"] == 0.5


def test_amax_is_what_te_records_skipping_nan_keeping_inf(pieces):
    """TE's amax kernels reduce with fmaxf (vectorized_pointwise.h:202): NaN skipped, Inf kept."""
    assert amax(torch.tensor([1.0, float("nan"), -3.0])).item() == 3.0
    assert amax(torch.tensor([1.0, float("nan"), -3.0, float("-inf")])).item() == INF
    assert amax(torch.tensor([float("nan")])).item() == 0.0
    assert amax(torch.zeros(0)).item() == 0.0
    assert amax(torch.tensor([0.5, -7.0], dtype=torch.bfloat16)).item() == 7.0


def _pool(rows: torch.Tensor) -> torch.Tensor:
    """What `all_reduce_sufficient_stats` does across ranks, over rows: SUM_KEYS summed,
    MAX_KEYS maxed (tests/test_stats_distributed.py runs the real all_reduce on 2 ranks)."""
    return torch.cat([rows[:, :len(SUM_KEYS)].sum(0), rows[:, len(SUM_KEYS):].amax(0)])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_pooled_pieces_equal_the_stats_of_the_whole_tensor(fmt, pieces):
    gen = torch.Generator().manual_seed(5)
    whole = torch.randn(3000, generator=gen) * torch.logspace(-10, 3, 3000)
    whole[7], whole[2500], whole[2600] = float("nan"), float("inf"), 0.0
    pieces = [whole[:1000], whole[1000:1001], whole[1001:2999], whole[2999:], whole[:0]]
    scale = FP8_MAX[fmt] / 64.0  # one scale for every piece: the pooled meaning is exact
    rows = torch.stack([sufficient_stats(p, fmt, scale) for p in pieces])
    pooled = dict(zip(STAT_KEYS, finalize_stats(_pool(rows)).tolist(), strict=True))
    want = tensor_stats(whole, fmt, scale=scale)
    ref = ref_stats([float(v) for v in whole], fmt, scale)
    for key in STAT_KEYS:
        assert pooled[key] == pytest.approx(want[key], rel=pooled_rel(key), abs=1e-300), key
    for key, value in ref.items():
        assert pooled[key] == pytest.approx(value, rel=1e-6), key
    assert pooled["nan_count"] == 1 and pooled["inf_count"] == 1
    # a piece nobody saw changes nothing
    padded = torch.cat([rows, empty_sufficient_stats(2)])
    assert torch.equal(_pool(padded), _pool(rows))
