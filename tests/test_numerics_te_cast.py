"""`numerics.quantize` byte for byte against TE's cast, written here from the CUDA sources.

TE's FP8 cast kernels (transformer_engine/common/transpose/cast_transpose.cu:162-163 for a
Linear's input and weight on Hopper, common/util/vectorized_pointwise.h:199-207 for the plain
cast; TE 2.20.0.dev0, d0067d0) read each element as float32 (`static_cast<float>`: a bfloat16 or
float16 widens exactly), multiply it by the float32 scale, and store `OType(in * scale)`, OType
being CUDA's `__nv_fp8_e4m3` / `__nv_fp8_e5m2`, whose float constructor converts with
`__nv_cvt_float_to_fp8(f, __NV_SATFINITE, fmt)` (cuda_fp8.hpp; on sm_89+ the
`cvt.rn.satfinite` instruction, elsewhere its software twin): round to nearest even, subnormals
included; a magnitude past the largest finite value, Inf included, becomes it with the sign kept
(E4M3 0x7E, E5M2 0x7B); a magnitude at or below half the smallest subnormal becomes a zero with
the sign kept; every NaN, of either sign and any payload, becomes the canonical 0x7F
(cuda_fp8.hpp: NaN inputs are first replaced by 0x7FFFFFFF, whose E4M3 and E5M2 images are
both 0x7F).

The reference below is exact integer arithmetic on the float32 bits (numpy), with the FP8 codes'
values decoded from the OCP formulas, so it shares nothing with torch's float8 conversion.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundry_fp8.numerics import quantize

#: exponent bias, mantissa bits, largest finite code (positive) of each format (OCP FP8)
FORMATS = {"e4m3": (7, 3, 0x7E), "e5m2": (15, 2, 0x7B)}
CANONICAL_NAN = 0x7F


def decode(code: int, fmt: str) -> float:
    """The value of a positive FP8 code (no NaN/Inf codes asked for)."""
    bias, mbits, _ = FORMATS[fmt]
    exponent, mantissa = code >> mbits, code & ((1 << mbits) - 1)
    if exponent == 0:
        return mantissa * 2.0 ** (1 - bias - mbits)
    return (1 + mantissa / 2 ** mbits) * 2.0 ** (exponent - bias)


def reference_cast(scaled: np.ndarray, fmt: str) -> np.ndarray:
    """float32 `scaled` (the product `in * scale`) -> FP8 bytes, as `__NV_SATFINITE` RNE."""
    bias, mbits, max_code = FORMATS[fmt]
    scaled = np.asarray(scaled, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        return _reference_cast(scaled.reshape(-1), bias, mbits, max_code, fmt).reshape(
            scaled.shape)


def _reference_cast(scaled: np.ndarray, bias: int, mbits: int, max_code: int, fmt: str
                    ) -> np.ndarray:
    bits = scaled.view(np.uint32).astype(np.int64)
    sign = (bits >> 31) << 7
    exp_field, frac = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    # |x| = m * 2**e exactly
    m = np.where(exp_field > 0, frac | (1 << 23), frac)
    e = np.where(exp_field > 0, exp_field - 150, -149)
    top = e + np.frexp(np.maximum(m, 1).astype(np.float64))[1].astype(np.int64) - 1  # floor(log2)
    # the FP8 quantum at |x|: 2**(top - mbits) for normals, the subnormal step below them
    quantum = np.maximum(top - mbits, 1 - bias - mbits)
    shift = quantum - e
    right = np.clip(shift, 0, 62)
    n = np.where(shift <= 0, m << np.clip(-shift, 0, 62), m >> right)
    remainder = np.where(shift <= 0, 0, m & ((np.int64(1) << right) - 1))
    half = np.where(shift <= 0, 1, np.int64(1) << np.clip(right - 1, 0, 62))
    up = (shift > 0) & ((remainder > half) | ((remainder == half) & (n % 2 == 1)))
    n = n + up
    # n * 2**quantum back to a code: the value table of every positive code
    values = {decode(code, fmt): code for code in range(max_code + 1)}
    magnitude = n.astype(np.float64) * np.exp2(quantum.astype(np.float64))
    maxval = decode(max_code, fmt)
    codes = np.array([values[v] if v <= maxval else max_code for v in magnitude.tolist()],
                     dtype=np.int64)
    codes = np.where(m == 0, 0, codes)
    codes = np.where(exp_field == 0xFF, np.where(frac == 0, max_code, -1), codes)  # Inf, NaN
    out = np.where(codes < 0, CANONICAL_NAN, codes | sign)
    return out.astype(np.uint8)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def _every(dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern of a 16-bit float dtype: all its values, NaNs, Infs, -0.0."""
    return torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)


def test_reference_decodes_the_formats_extremes():
    """The reference's own anchors, from the OCP spec: largest finite and smallest subnormal."""
    assert decode(0x7E, "e4m3") == 448.0 and decode(0x01, "e4m3") == 2.0 ** -9
    assert decode(0x7B, "e5m2") == 57344.0 and decode(0x01, "e5m2") == 2.0 ** -16


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 448.0 / 3.1, 2.0 ** -20, 3.4028234663852886e38])
def test_every_16_bit_input_casts_to_tes_bytes(fmt, dtype, scale):
    """All 65536 bfloat16 / float16 patterns times a float32 scale (1, a non-power of 2, a tiny
    one that flushes most values, float32 max as an overflowed update leaves it)."""
    x = _every(dtype)
    scale32 = np.float32(scale)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = x.float().numpy() * scale32  # float32 product, as TE's kernel
    want = reference_cast(scaled, fmt)
    got = _bytes(quantize(x, torch.tensor(scale32), fmt))
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} of 65536 differ, e.g. input bits "
                           f"{x.view(torch.int16)[bad[0]].item() & 0xFFFF:#06x}: "
                           f"got {got[bad[0]]:#04x}, TE {want[bad[0]]:#04x}")


def _float32_edges(fmt: str) -> np.ndarray:
    """float32 values at and one ulp either side of every FP8 value and every midpoint between
    neighbours (the ties), with both signs, plus NaNs of both signs and several payloads."""
    bias, mbits, max_code = FORMATS[fmt]
    grid = [decode(c, fmt) for c in range(max_code + 1)]
    points = grid + [(a + b) / 2 for a, b in zip(grid, grid[1:], strict=False)]
    points += [grid[-1] + (grid[-1] - grid[-2]) / 2, 2.0 ** (-bias - mbits), 1e30, 3e38]
    centre = np.array(points, dtype=np.float32)
    around = np.concatenate([np.nextafter(centre, np.float32(-np.inf)), centre,
                             np.nextafter(centre, np.float32(np.inf))])
    nan_bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF],
                        dtype=np.uint32)
    special = np.array([np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45], dtype=np.float32)
    return np.concatenate([around, -around, nan_bits.view(np.float32), special])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_float32_ties_saturation_subnormals_and_nans_cast_as_te(fmt):
    """float32 at every FP8 value and tie, one ulp either side: round to nearest even;
    values past the largest finite one (Inf too) saturate with their sign; tiny values keep
    their sign as -0 (0x80); every NaN is 0x7F (torch writes 0xFF for a negative NaN, which
    x86 makes for inf - inf)."""
    values = _float32_edges(fmt)
    want = reference_cast(values, fmt)
    got = _bytes(quantize(torch.from_numpy(values), 1.0, fmt))
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} of {values.size} differ, e.g. "
                           f"{values.view(np.uint32)[bad[0]]:#010x}: got {got[bad[0]]:#04x}, "
                           f"TE {want[bad[0]]:#04x}")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_random_float32_inputs_scaled_in_float32_cast_as_te(fmt):
    """Random float32 inputs over 80 binades times non-power-of-2 scales: the product is
    rounded to float32 first (TE multiplies in float32), then cast."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-40, 40, 200_000))).astype(np.float32)
    for scale in (np.float32(448.0 / 2.7182817), np.float32(57344.0 / 1234.5678)):
        with np.errstate(over="ignore"):
            want = reference_cast(x * scale, fmt)
        got = _bytes(quantize(torch.from_numpy(x), torch.tensor(scale), fmt))
        assert np.array_equal(got, want)
