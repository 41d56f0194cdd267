"""The emulated GEMMs multiply the FP8 operands in float32 whatever torch's matmul settings say.

TE's FP8 GEMMs (cuBLAS FP8: exact products of the FP8 values, float32 accumulation, the scales
`scale_inv_a * scale_inv_b` applied to the result) are reached by neither torch's float32 matmul
precision nor torch autocast. The emulation multiplies the dequantized operands `fp8 *
scale_inv` (up to 24 significant bits) with torch's float32 matmul, which rounds them again at
precision "high" (TF32 on a GPU: Composer's GPU device sets `allow_tf32=True` by default) or
"medium" (bfloat16, on CPU too), and in autocast's dtype when a backward runs inside torch
autocast. Each test compares with a float64 reference of TE's arithmetic, written here:

- current scaling's scale: `fp8_max / amax` in float32 (common/recipe/recipe_common.cuh:14-49,
  `__fdiv_rn`), the amax the largest magnitude (common/recipe/current_scaling.cu:32-71);
- the cast `x * scale` in float32, round-to-nearest-even onto the FP8 grid, saturating
  (`tests.test_numerics.ref_round`; common/util/vectorized_pointwise.h:202-206, cuda_fp8.hpp
  `__NV_SATFINITE`); `scale_inv = 1 / scale` rounded once (common/util/utils.cuh `__frcp_rn`);
- the GEMM: the exact sum of the FP8 products times both `scale_inv`, accumulated in float32,
  so within `k * 2**-24 * sum |a_i b_i|` of the float64 value (k the inner dimension).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe
from tests.test_numerics import f32, ref_round

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def te_round_trip(t: torch.Tensor, fmt: str) -> np.ndarray:
    """t cast as TE's per-tensor current scaling casts it, dequantized exactly (float64)."""
    values = t.detach().double().flatten().tolist()
    scale = f32(FP8_MAX[fmt] / f32(max(abs(v) for v in values)))
    scale_inv = f32(1.0 / scale)
    out = [ref_round(f32(v * scale), fmt) * scale_inv for v in values]
    return np.array(out, dtype=np.float64).reshape(t.shape)


def te_operands(
    x: torch.Tensor, layer: EmulatedFP8Linear, dy: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The FP8 operands TE's HYBRID current scaling multiplies: x and W in E4M3, dY in E5M2."""
    return (
        te_round_trip(x, "e4m3"),
        te_round_trip(layer.weight.cpu(), "e4m3"),
        te_round_trip(dy, "e5m2"),
    )


def assert_float32_gemm(got: torch.Tensor, a: np.ndarray, b: np.ndarray) -> None:
    """got = a @ b accumulated in float32 from exact products (bound from the inner dim)."""
    exact = a @ b
    bound = a.shape[1] * 2.0**-24 * (np.abs(a) @ np.abs(b)) + 1e-300
    error = np.abs(got.double().numpy() - exact)
    assert (error <= bound).all(), f"worst {float((error / bound).max()):.3g} x the float32 bound"


def _run(
    x: torch.Tensor, layer: EmulatedFP8Linear, dy: torch.Tensor, *, backward_in: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    layer.weight.grad = None
    with fp8_autocast(recipe=FP8Recipe(scaling="current")):
        y = layer(x)
    if backward_in:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y.backward(dy)
    else:
        y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad


@pytest.fixture
def operands() -> tuple[torch.Tensor, EmulatedFP8Linear, torch.Tensor]:
    gen = torch.Generator().manual_seed(28)
    x = torch.randn(32, 64, generator=gen) * torch.logspace(-2, 1, 64)
    layer = EmulatedFP8Linear(64, 48, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64, generator=gen) * 0.37)
    return x, layer, torch.randn(32, 48, generator=gen) * 1e-3


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_gemms_are_float32_at_any_matmul_precision(operands, precision):
    """At "medium" the CPU GEMMs were bfloat16: every output and gradient moved, hundreds of
    times the float32 bound; the user's setting is back afterwards."""
    x, layer, dy = operands
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        y, dx, dw = _run(x, layer, dy, backward_in=False)
        assert torch.get_float32_matmul_precision() == precision
    finally:
        torch.set_float32_matmul_precision(before)
    qx, qw, qdy = te_operands(x, layer, dy)
    assert_float32_gemm(y, qx, qw.T)
    assert_float32_gemm(dx, qdy, qw)
    assert_float32_gemm(dw, qdy.T, qx)


def test_backward_inside_torch_autocast_keeps_float32_gemms(operands):
    """A backward called inside torch autocast ran the dgrad and wgrad GEMMs in bfloat16."""
    x, layer, dy = operands
    _, dx, dw = _run(x, layer, dy, backward_in=True)
    qx, qw, qdy = te_operands(x, layer, dy)
    assert_float32_gemm(dx, qdy, qw)
    assert_float32_gemm(dw, qdy.T, qx)


@pytest.mark.gpu
def test_gemms_are_float32_under_composers_tf32_default(operands):
    """Composer's DeviceGPU sets `torch.backends.cuda.matmul.allow_tf32 = True` by default:
    TF32 operands keep 10 mantissa bits of the dequantized FP8 values."""
    x, layer, dy = operands
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        y, dx, dw = _run(x.cuda(), layer.cuda(), dy.cuda(), backward_in=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    qx, qw, qdy = te_operands(x, layer, dy)
    assert_float32_gemm(y.cpu(), qx, qw.T)
    assert_float32_gemm(dx.cpu(), qdy, qw)
    assert_float32_gemm(dw.cpu(), qdy.T, qx)


def test_overlapping_gemms_keep_float32_and_give_the_setting_back():
    """Two threads' GEMMs overlapping (nn.DataParallel's replicas, CUDA backward threads), in
    the schedule A in, B in, A out, B out: B's GEMM ran at the user's "medium" once A restored
    it, and B then restored the "highest" it found, losing the user's setting for good."""
    from foundry_fp8.emulate import _float32_gemms

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        first, second = _float32_gemms("cpu"), _float32_gemms("cpu")
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        inside = torch.get_float32_matmul_precision()
        second.__exit__(None, None, None)
        after = torch.get_float32_matmul_precision()
    finally:
        torch.set_float32_matmul_precision(before)
    assert (inside, after) == ("highest", "medium")
