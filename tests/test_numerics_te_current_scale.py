"""Current scaling's scale for every kind of amax, as TE's GPU path computes it.

TE's per-tensor current scaling (Float8CurrentScalingQuantizer::quantize_impl,
transformer_engine/pytorch/csrc/quantizer.cpp:960-1003 at v2.18) takes the amax with
`nvte_compute_amax_with_config` (common/recipe/current_scaling.cu:32-71: fmaxf / __hmax from 0,
so a NaN element is skipped, an Inf kept, and the amax is never NaN), all-reduces it (MAX) where
the quantizer asks, then runs `compute_scale_from_amax_kernel` (current_scaling.cu:267-276) with
the quantizer's `amax_epsilon` and `force_pow_2_scales` and float32 max as the value for an
overflowing quotient. `compute_scale_from_amax` (common/recipe/recipe_common.cuh:14-49, the same
at d0067d0; since v2.4 NaN returns early, before it the NaN quotient became 1 at the end: the
same result):

- `amax < epsilon` -> epsilon (a NaN compares false and stays NaN), then
- Inf, 0 or NaN -> 1 (before any power of 2),
- else `__fdiv_rn(fp8_max, amax)`, float32 max where that overflows, and with
  `force_pow_2_scales` only the sign and exponent bits kept (`& 0xFF800000`).

TE's Python references say otherwise for an Inf amax: tests/pytorch/references/
quantize_scale_calc.py:31-53 and pytorch/custom_recipes/quantization_ref_current_scaling.py:
155-193 compute `fp8_max / inf = 0` and keep it (1 only for a zero amax). They are test and
custom-recipe references, not the kernels Float8CurrentScaling runs: the emulation follows the
kernel, and these tests pin each case to it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from foundry_fp8.numerics import FP8_MAX, amax, current_scale, quantize, scale_inverse

F32 = np.float32
F32_MAX = F32(np.finfo(np.float32).max)


def te_current_scale(amax_value: F32, fp8_max: float, power_2: bool, epsilon: float = 0.0
                     ) -> F32:
    """compute_scale_from_amax (recipe_common.cuh:14-49) in float32, as current_scaling.cu
    calls it (value_for_inf float32 max); epsilon is the quantizer's float `amax_epsilon`."""
    amax_value = F32(amax_value)
    if amax_value < F32(epsilon):  # NaN < epsilon is false
        amax_value = F32(epsilon)
    if np.isinf(amax_value) or amax_value == 0 or np.isnan(amax_value):
        return F32(1.0)
    with np.errstate(over="ignore"):
        scale = F32(fp8_max) / amax_value
    if np.isinf(scale):
        scale = F32_MAX
    if power_2:
        scale = (np.array([scale]).view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)[0]
    return scale


def _emulated(amaxes: list[float] | np.ndarray, fmt: str, power_2: bool, epsilon: float = 0.0
              ) -> np.ndarray:
    return current_scale(torch.as_tensor(np.asarray(amaxes, dtype=np.float32)), fmt,
                         epsilon=epsilon, power_2=power_2).numpy()


TINY = float(np.nextafter(F32(0), F32(1)))  # the smallest float32 subnormal: 448 / it overflows


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize(("amax_value", "epsilon", "want"), [
    (math.inf, 0.0, 1.0),  # the kernel's 1, not the Python references' 0
    (math.nan, 0.0, 1.0),
    (0.0, 0.0, 1.0),
    (-0.0, 0.0, 1.0),
    (math.inf, 1e-3, 1.0),  # epsilon raises no Inf or NaN amax
    (math.nan, 1e-3, 1.0),
    (0.0, 1e-3, "fp8_max / epsilon"),  # a zero amax below epsilon is epsilon: no longer 1
    (2e-4, 1e-3, "fp8_max / epsilon"),
    (1e-3, 1e-3, "fp8_max / epsilon"),
    (TINY, 0.0, "float32 max"),
    (3.0, 0.0, "fp8_max / amax"),
    (3.0e38, 0.0, "fp8_max / amax"),
])
def test_each_kind_of_amax_gives_the_kernels_scale(fmt, power_2, amax_value, epsilon, want):
    fp8_max = FP8_MAX[fmt]
    if want == "fp8_max / epsilon":
        expected = F32(fp8_max) / F32(epsilon)
    elif want == "fp8_max / amax":
        expected = F32(fp8_max) / F32(amax_value)
    else:
        expected = F32_MAX if want == "float32 max" else F32(want)
    if power_2 and want != 1.0:  # sign and exponent bits: 2**floor(log2(scale))
        expected = 2.0 ** (math.frexp(float(expected))[1] - 1)
    got = _emulated([amax_value], fmt, power_2, epsilon)[0]
    assert got == F32(expected) == te_current_scale(F32(amax_value), fp8_max, power_2, epsilon)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 1e-12, 0.1, 2.0 ** -120])
def test_every_float32_amax_bit_for_bit(fmt, power_2, epsilon):
    """Random float32 bit patterns of every exponent (subnormals, Inf, NaN payloads included):
    the emulation's scale equals the kernel's, bit for bit."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2 ** 31, 20_000, dtype=np.uint32)
    bits[:4] = [0, 1, 0x7F800000, 0x7FC00001]  # 0, smallest subnormal, Inf, a NaN
    amaxes = bits.view(np.float32)
    got = _emulated(amaxes, fmt, power_2, epsilon)
    want = np.array([te_current_scale(a, FP8_MAX[fmt], power_2, epsilon) for a in amaxes])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_a_tensor_with_an_inf_casts_at_scale_1_and_saturates(fmt):
    """The amax TE takes keeps an Inf and skips a NaN: an Inf makes the scale 1 (the finite
    rest cast as is, saturating and flushing), a NaN alone changes nothing, and an all-NaN
    tensor has amax 0, scale 1; the Python references' scale 0 would make every element 0 and
    scale_inv infinite."""
    fp8_max = FP8_MAX[fmt]
    x = torch.tensor([1e5, -2.0, 1e-9, math.nan, -math.inf])
    assert amax(x).item() == math.inf
    scale = current_scale(amax(x), fmt)
    assert scale.item() == 1.0 and scale_inverse(scale).item() == 1.0
    q = quantize(x, scale, fmt).float()
    assert q[0].item() == fp8_max and q[1].item() == -2.0 and q[2].item() == 0.0
    assert math.isnan(q[3].item()) and q[4].item() == -fp8_max
    assert amax(x[:4]).item() == F32(1e5)  # the NaN skipped
    assert current_scale(amax(torch.full((3,), math.nan)), fmt).item() == 1.0
