"""The emulation's numerics against references re-derived from TE 2.20.2, sharing no code with
foundry_fp8 or with the other TE-reference tests (exact `Fraction` arithmetic for the casts, a
line-by-line Python transcription of the CUDA kernels for the scales and the history roll).

Sources (TE 2.20.2's wheel for Python; its CUDA from the mirror at main d0067d0, which 2.20.2
was cut from, unchanged in these functions since v2.18):
- cast: `OType(static_cast<float>(in) * scale)` (common/cast/fp8/quantize_fp8.cuh,
  common/transpose/cast_transpose.cu:163), OType's constructor converting with
  `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, fmt)` (cuda_fp8.hpp:245-275, CUDA 13.0):
  round-to-nearest-even, a magnitude past the largest finite (Inf included) saturates to it,
  NaN of any sign becomes 0x7FFFFFFF first, so the canonical 0x7F; not built with fast math
  (common/CMakeLists.txt:616-655 lists the fast-math sources: no cast), so float32 denormals
  are kept;
- amax: `fmaxf(fabsf(in), amax)` from 0 (cast_transpose.cu:165, quantize_fp8.cuh:175), NaN
  skipped, Inf kept, max-accumulated into history row 0 (`atomicMaxFloat`, utils.cuh:935);
- current scaling: `compute_scale_from_amax` (common/recipe/recipe_common.cuh:14-47) with
  `value_for_inf` float32 max (current_scaling.cu:274-275); TE 2.20.2's Float8CurrentScaling
  QParams set `amax_epsilon=0.0` for input, weight and grad (common/recipe/__init__.py:304-306);
- delayed scaling: `kernel_bulk` (common/recipe/delayed_scaling.cu:160-253), scaled_max =
  `fp8_max * std::pow(2.f, -margin)` (l. 330-331, 391), run by TE 2.20.2's
  `reduce_and_update_fp8_tensors` (pytorch/quantization.py:656-711) on the fused path.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch

import foundry_fp8.emulate as emulate
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.numerics import (
    amax,
    current_scale,
    delayed_scale_update,
    dequantize,
    quantize,
    scale_inverse,
)
from foundry_fp8.recipe import FP8Recipe

F32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)
#: (mantissa bits, exponent bias, largest finite value) per format (OCP FP8).
SPEC = {"e4m3": (3, 7, 448.0), "e5m2": (2, 15, 57344.0)}


# -- the cast ----------------------------------------------------------------------------------

def _round_half_even(q: Fraction) -> int:
    floor = q.numerator // q.denominator
    rest = q - floor
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and floor % 2 == 1):
        return floor + 1
    return floor


def fp8_byte(v: float, fmt: str) -> int:
    """The byte `__nv_cvt_float_to_fp8(v, __NV_SATFINITE, fmt)` gives for a float32 value v."""
    mbits, bias, top = SPEC[fmt]
    if math.isnan(v):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(v)
    if math.isinf(a) or a >= top:
        a_q = Fraction(top)
    else:
        a = Fraction(a)
        emin = 1 - bias
        e = emin if a == 0 else max(emin, math.floor(math.log2(a)))
        # floor(log2) exactly: correct the float estimate
        while a != 0 and e > emin and Fraction(2) ** e > a:
            e -= 1
        while a != 0 and Fraction(2) ** (e + 1) <= a:
            e += 1
        quantum = Fraction(2) ** (e - mbits)
        a_q = min(_round_half_even(a / quantum) * quantum, Fraction(top))
    if a_q == 0:
        return sign
    emin = 1 - bias
    if a_q < Fraction(2) ** emin:  # subnormal
        return sign | int(a_q / Fraction(2) ** (emin - mbits))
    e = math.floor(math.log2(a_q))
    mant = int(a_q / Fraction(2) ** e * 2 ** mbits) - 2 ** mbits
    return sign | ((e + bias) << mbits) | mant


def _grid(fmt: str) -> list[float]:
    """Every non-negative finite FP8 value, ascending, decoded from the OCP layout."""
    mbits, bias, top = SPEC[fmt]
    values = [m * 2.0 ** (1 - bias - mbits) for m in range(2 ** mbits)]
    e = 1 - bias
    while True:
        for m in range(2 ** mbits):
            v = (1 + m / 2 ** mbits) * 2.0 ** e
            if v > top:
                return values
            values.append(v)
        e += 1


def _edge_inputs(fmt: str) -> np.ndarray:
    """Grid points, the exact ties between neighbours and one float32 ulp either side of them,
    the largest value and past it, float32 denormals, Inf, NaN: both signs."""
    grid = _grid(fmt)
    out: list[float] = []
    for lo, hi in zip(grid, [*grid[1:], grid[-1] * 2], strict=True):
        mid = F32((lo + hi) / 2)  # exact: a tie of two FP8 neighbours fits float32
        out += [lo, float(mid), float(np.nextafter(mid, F32(0))),
                float(np.nextafter(mid, F32(np.inf)))]
    out += [1e-45, 1e-40, 1.1754942e-38, FLT_MAX, math.inf, math.nan, 0.0]
    values = np.array(out, dtype=np.float32)
    return np.concatenate([values, -values])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_reference_grid_is_the_ocp_formats(fmt):
    grid = _grid(fmt)
    assert grid[-1] == SPEC[fmt][2] and grid[1] == {"e4m3": 2.0 ** -9, "e5m2": 2.0 ** -16}[fmt]
    assert [fp8_byte(v, fmt) for v in grid] == list(range(len(grid)))  # codes in value order
    assert fp8_byte(-0.0, fmt) == 0x80 and fp8_byte(-math.inf, fmt) == 0x80 | len(grid) - 1


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_float32_ties_boundaries_denormals_cast_as_satfinite_rne(fmt):
    values = _edge_inputs(fmt)
    got = quantize(torch.from_numpy(values), torch.tensor(1.0), fmt).view(torch.uint8).tolist()
    want = [fp8_byte(float(v), fmt) for v in values]
    bad = [(float(v), g, w) for v, g, w in zip(values, got, want, strict=True) if g != w]
    assert not bad, f"{len(bad)} of {len(values)} differ, e.g. {bad[:5]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_scaled_cast_multiplies_in_float32_then_rounds_once(fmt, dtype):
    """Non-power-of-2 scales (the current scale of the tensor, and two others) on inputs that
    hold NaN, +-Inf, zeros and spikes: the product is float32's, rounded before the cast."""
    gen = torch.Generator().manual_seed(25)
    x = (torch.randn(600, generator=gen) * torch.logspace(-6, 4, 600)).to(dtype)
    x[[3, 17, 400]] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
    x[50:60] = 0.0
    xs = x.float().numpy()
    finite_amax = float(np.nanmax(np.abs(xs[np.isfinite(xs)])))
    for scale in (F32(SPEC[fmt][2]) / F32(finite_amax), F32(0.7), F32(3.3e5)):
        got = quantize(x, torch.tensor(float(scale)), fmt).view(torch.uint8).tolist()
        with np.errstate(invalid="ignore", over="ignore"):
            products = (xs * scale).astype(np.float32)
        want = [fp8_byte(float(p), fmt) for p in products]
        assert got == want, f"scale {scale}: {sum(g != w for g, w in zip(got, want, strict=True))} differ"
        # dequantized as TE's GEMM reads it: code value times the float32 reciprocal
        inv = F32(1) / scale
        assert scale_inverse(torch.tensor(float(scale))).item() == float(inv)
        q = quantize(x, torch.tensor(float(scale)), fmt)
        deq = dequantize(q, torch.tensor(float(scale))).numpy()
        codes = q.float().numpy()
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(deq, (codes * inv).astype(np.float32))


# -- amax and the scales -------------------------------------------------------------------------

def te_amax(values: list[float]) -> float:
    """fmaxf(fabsf(v), amax) from 0: NaN skipped (fmaxf returns the other operand)."""
    out = 0.0
    for v in values:
        out = float(np.fmax(F32(abs(v)), F32(out)))
    return out


def te_current_scale(amax_value: float, fp8_max: float, power_2: bool,
                     epsilon: float = 0.0) -> float:
    """recipe_common.cuh:14-47 with value_for_inf float32 max."""
    a = F32(amax_value)
    if a < F32(epsilon):  # NaN compares false: kept, then scale 1
        a = F32(epsilon)
    if math.isinf(a) or a == 0 or math.isnan(a):
        return 1.0
    with np.errstate(over="ignore"):
        scale = F32(fp8_max) / a  # __fdiv_rn
    if math.isinf(scale):
        scale = F32(FLT_MAX)
    if power_2:
        scale = (np.array([scale], np.float32).view(np.uint32) & np.uint32(0xFF800000)).view(
            np.float32)[0]
    return float(scale)


AMAXES = [0.0, math.inf, math.nan, 1e-45, 1e-40, 1.1754942e-38, 1.2e-38, 3.7e-36, 1e-10, 0.3,
          1.0, 447.99997, 448.0, 448.00003, 57344.0, 1e20, 3.0e38, FLT_MAX]


@pytest.mark.parametrize("epsilon", [0.0, 1e-3])
@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_current_scale_is_compute_scale_from_amax(fmt, power_2, epsilon):
    gen = np.random.default_rng(7)
    amaxes = AMAXES + [float(F32(v)) for v in 10.0 ** gen.uniform(-38, 38, 400)]
    got = current_scale(torch.tensor(amaxes, dtype=torch.float32), fmt, epsilon=epsilon,
                        power_2=power_2).tolist()
    want = [te_current_scale(a, SPEC[fmt][2], power_2, epsilon) for a in amaxes]
    bad = [(a, g, w) for a, g, w in zip(amaxes, got, want, strict=True) if g != w]
    assert not bad, f"{len(bad)} of {len(amaxes)}: {bad[:4]}"


def test_amax_skips_nan_keeps_inf_in_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for values in ([math.nan, 2.0, -3.0], [math.nan] * 4, [0.0, -0.0], [-math.inf, 1.0],
                       [math.nan, -math.inf], [], [-5e-40 if dtype == torch.float32 else -1e-7]):
            t = torch.tensor(values, dtype=dtype)
            assert amax(t).item() == te_amax(t.float().tolist()), (dtype, values)


class KernelBulk:
    """delayed_scaling.cu:160-253 for one tensor (`count`), transcribed line by line; the
    reduction buffer's value stands for row 0 after the all-reduce (l. 182-185)."""

    def __init__(self, length: int):
        self.history = [F32(0)] * length
        self.scale = F32(1)

    def record(self, value: float) -> None:
        self.history[0] = max(self.history[0], F32(value))  # atomicMaxFloat, value not NaN

    def update(self, fp8_max: float, algo: str, margin: int) -> None:
        length = len(self.history)
        last_amax = self.history[0]
        amax = F32(0)
        if last_amax != 0:  # NaN != 0 too
            new = list(self.history)
            for i in range(length):
                a = self.history[i + 1] if i < length - 1 else last_amax
                amax = np.fmax(amax, a)
                new[i] = a if i > 0 else F32(0)
            self.history = new
        if algo == "most_recent":
            amax = last_amax
        scaled_max = F32(fp8_max) * F32(math.pow(2.0, -margin))
        if math.isfinite(amax) and amax > 0:
            with np.errstate(over="ignore"):
                scale = scaled_max / F32(amax)
        else:
            scale = self.scale
        if math.isinf(scale):
            scale = F32(FLT_MAX)
        self.scale = F32(scale)


def _amax_stream(steps: int, gen: np.random.Generator) -> list[list[float]]:
    """Per step, the amax each of 5 columns records: spikes, zeros (nothing cast), Inf, a
    denormal whose scale overflows, NaN (only a restored history holds one)."""
    out = []
    for step in range(steps):
        row = [float(F32(v)) for v in 10.0 ** gen.uniform(-3, 3, 5)]
        row[step % 5] *= 1e4  # a spike moving across columns
        if step % 4 == 1:
            row[1] = 0.0
        if step == 6:
            row[2] = math.inf
        if step == 8:
            row[3] = 1e-40
        if step == 10:
            row[4] = math.nan
        out.append(row)
    return out


@pytest.mark.parametrize("length", [1, 2, 5, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_delayed_update_is_kernel_bulk_for_fifteen_steps(length, algo, margin, fmt):
    gen = np.random.default_rng(length * 7 + margin)
    columns = [KernelBulk(length) for _ in range(5)]
    history, scale = torch.zeros(length, 5), torch.ones(5)
    for step, row in enumerate(_amax_stream(15, gen)):
        for col, value in zip(columns, row, strict=True):
            if math.isnan(value):
                col.history[0] = F32(value)  # as a restored checkpoint would hold it
            else:
                col.record(value)
            col.update(SPEC[fmt][2], algo, margin)
        history[0] = torch.maximum(history[0], torch.tensor(row))  # NaN propagates
        history, scale = delayed_scale_update(history, scale, SPEC[fmt][2], algo, margin)
        want_h = np.array([c.history for c in columns], dtype=np.float32).T
        want_s = np.array([c.scale for c in columns], dtype=np.float32)
        np.testing.assert_array_equal(history.numpy(), want_h, err_msg=f"step {step} history")
        np.testing.assert_array_equal(scale.numpy(), want_s, err_msg=f"step {step} scale")


# -- the layer, step by step ---------------------------------------------------------------------

def _step_inputs(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Input, output gradient and a weight factor per step: a spike at step 4 (it must leave a
    window of length L after L updates), zeros at 3, Inf at 6, NaN at 8, tiny at 10."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 16, generator=gen)
    g = torch.randn(16, 16, generator=gen) * 10.0 ** (step % 3 - 1)
    if step == 4:
        x[1, 2] = 3.0e4 if dtype != torch.float16 else 6.0e4
    if step == 3:
        x.zero_()
    if step == 6:
        x[0, 0] = math.inf
        g[2, 3] = -math.inf
    if step == 8:
        x[3, 3] = math.nan
        g[0, 1] = math.nan
    if step == 10:
        x = x * 1e-35 if dtype == torch.float32 else x * 1e-6
    return x.to(dtype), g.to(dtype), 1.0 + step / 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "length", "algo", "margin"), [
    ("HYBRID", 1, "max", 0), ("HYBRID", 3, "max", 2), ("E4M3", 4, "most_recent", 1),
    ("HYBRID", 1024, "max", 0)])
def test_fourteen_layer_steps_follow_te_state_machine(dtype, fmt, length, algo, margin):
    """Two micro-batches per step (two forwards in one autocast, then one backward over both:
    row 0 takes their max before the single update), weights rescaled each step; the scale each
    cast ran with (read before the step) and the histories and scales after it, bit for bit."""
    recipe = FP8Recipe(fp8_format=fmt, amax_history_len=length, amax_compute_algo=algo,
                       margin=margin)
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(16, 16, bias=False, dtype=dtype)
    base = layer.weight.detach().clone()
    cols = {k: KernelBulk(length) for k in ("x", "w", "g")}
    bwd_max = SPEC["e5m2" if fmt == "HYBRID" else "e4m3"][2]
    for step in range(14):
        x, g, factor = _step_inputs(step, dtype)
        x2, g2 = x.flip(0) * 0.5, g.flip(0) * 2
        with torch.no_grad():
            layer.weight.copy_(base * factor)
        fwd, bwd = layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"]
        assert fwd.scale[:2].tolist() == [float(cols["x"].scale), float(cols["w"].scale)], step
        assert bwd.scale[0].item() == float(cols["g"].scale), step
        with fp8_autocast(recipe=recipe):
            out = layer(x.requires_grad_(True))
            out2 = layer(x2.requires_grad_(True))
        ((out.float() * g.float()).sum() + (out2.float() * g2.float()).sum()).backward()
        layer.weight.grad = None
        w = layer.weight.detach().float().reshape(-1).tolist()
        cols["x"].record(max(te_amax(x.float().reshape(-1).tolist()),
                             te_amax(x2.float().reshape(-1).tolist())))
        cols["w"].record(te_amax(w))
        for k in ("x", "w"):
            cols[k].update(448.0, algo, margin)
        cols["g"].record(max(te_amax(g.float().reshape(-1).tolist()),
                             te_amax(g2.float().reshape(-1).tolist())))
        cols["g"].update(bwd_max, algo, margin)
        for meta, keys in ((fwd, ("x", "w")), (bwd, ("g",))):
            for slot, k in enumerate(keys):
                np.testing.assert_array_equal(meta.amax_history[:, slot].numpy(),
                                              np.array(cols[k].history, dtype=np.float32),
                                              err_msg=f"step {step} {k} history")
                assert meta.scale[slot].item() == float(cols[k].scale), (step, k)
        assert fwd.scale[2].item() == 1.0 and not fwd.amax_history[:, 2].any()  # output slot
        assert bwd.scale[1].item() == 1.0 and not bwd.amax_history[:, 1].any()  # grad input


@pytest.mark.parametrize("power_2", [False, True])
def test_current_scaling_layer_casts_with_each_tensors_own_scale(power_2):
    """Current scaling: each forward's input and weight cast at their own scale (zeros and Inf
    at scale 1), the output equal to the product of the reference-decoded FP8 operands."""
    recipe = FP8Recipe(scaling="current", use_power_2_scales=power_2)
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(16, 16, bias=False)
    for step in (0, 3, 4, 6, 10):
        x, _, _ = _step_inputs(step, torch.float32)
        with fp8_autocast(recipe=recipe):
            out = layer(x)
        want = []
        for t in (x, layer.weight.detach()):
            values = t.reshape(-1).tolist()
            s = F32(te_current_scale(te_amax(values), 448.0, power_2))
            with np.errstate(invalid="ignore", over="ignore"):
                codes = [fp8_byte(float(F32(v) * s), "e4m3") for v in values]
            decoded = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
            want.append(decoded.reshape(t.shape).double() * float(F32(1) / s))
        ref = want[0] @ want[1].T  # exact: products of FP8 values and powers of 2 sum exactly
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(out)), step
        # the float32 GEMM's own rounding: a few ulps of the summed magnitudes
        bound = 1e-6 * (want[0].abs() @ want[1].abs().T)
        assert ((out.double() - ref).abs()[finite] <= bound[finite]).all(), step


# -- NVTE_UNFUSED_FP8_UPDATE as TE 2.20.2 reads it -------------------------------------------------

def _one_delayed_step() -> list[str]:
    """The messages of the warnings one delayed-scaling step gives about the unfused update."""
    layer = EmulatedFP8Linear(16, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fp8_autocast(recipe=FP8Recipe()):
            out = layer(torch.randn(16, 16))
        out.sum().backward()
    return [str(w.message) for w in caught if "NVTE_UNFUSED_FP8_UPDATE" in str(w.message)]


@pytest.mark.parametrize(("value", "unfused"), [("00", False), (" 0 ", False), ("-0", False),
                                                ("2", True), ("-1", True), ("1", True)])
def test_unfused_switch_is_read_with_int_as_te(monkeypatch, value, unfused):
    """TE 2.20.2: `bool(int(os.getenv("NVTE_UNFUSED_FP8_UPDATE", "0")))` (pytorch/
    quantization.py:687-688): "00" keeps the fused kernel, which the emulation models (it
    warned of the unfused path), any nonzero integer takes the unfused one."""
    monkeypatch.setattr(emulate, "_WARNED", {})
    monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", value)
    assert len(_one_delayed_step()) == int(unfused)


@pytest.mark.parametrize("value", ["true", "", "yes"])
def test_unfused_switch_int_refuses_stops_the_first_update_as_te(monkeypatch, value):
    """A value `int` refuses makes TE's first delayed-scaling update raise ValueError (the
    GPU run stops at its first step); the emulation warned that TE would run unfused and
    trained on. Now it stops there too, with one line naming the variable."""
    monkeypatch.setattr(emulate, "_WARNED", {})
    monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", value)
    with pytest.raises(ValueError) as caught:
        _one_delayed_step()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"NVTE_UNFUSED_FP8_UPDATE={value!r}: ")


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_restored_odd_scales_are_kept_or_replaced_as_kernel_bulk(algo):
    """Scales a checkpoint may hold (Inf, NaN, 0, float32 max, a denormal) meet amaxes of 0
    (nothing recorded), Inf and a finite value: kept where the amax is unusable, but an Inf
    kept becomes float32 max (delayed_scaling.cu:238-249)."""
    odd = [math.inf, math.nan, 0.0, FLT_MAX, 1e-40]
    cases = [(s, a) for s in odd for a in (0.0, math.inf, 2.5)]
    history = torch.zeros(3, len(cases))
    history[0] = torch.tensor([a for _, a in cases])
    history[1] = 7.0  # an older amax in the window
    scale = torch.tensor([s for s, _ in cases])
    new_history, new_scale = delayed_scale_update(history, scale, 448.0, algo, 1)
    for i, (s, a) in enumerate(cases):
        col = KernelBulk(3)
        col.history = [F32(a), F32(7.0), F32(0.0)]
        col.scale = F32(s)
        col.update(448.0, algo, 1)
        assert new_history[:, i].tolist() == [float(v) for v in col.history], (s, a)
        got, want = new_scale[i].item(), float(col.scale)
        assert got == want or (math.isnan(got) and math.isnan(want)), (s, a, got, want)


def test_scale_inverse_is_frcp_rn_at_the_extremes():
    """`scale_inv = 1 / scale` rounded once (`reciprocal` -> __frcp_rn, utils.cuh), denormal
    results kept (no fast math): float32 max's reciprocal is a float32 denormal, which the
    dequantize of an overflowing delayed scale multiplies by."""
    scales = [FLT_MAX, 2.0 ** 127, 3.0e38, 448.0 / 3.0, 1.1754944e-38, 1e-40, 7.0, 0.1]
    got = scale_inverse(torch.tensor(scales, dtype=torch.float32)).tolist()
    with np.errstate(over="ignore"):
        want = [float(F32(1) / F32(s)) for s in scales]
    assert got == want
    assert 0 < got[0] < 1.1754944e-38  # a denormal, not flushed


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_random_float32_bit_patterns_cast_as_satfinite_rne(fmt):
    """20,000 float32 bit patterns drawn uniformly from all 2**32 (NaNs with payloads, Infs,
    denormals, both signs), then 20,000 within the format's range, at scale 1."""
    gen = np.random.default_rng(2520)
    wide = gen.integers(0, 2 ** 32, 20_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = (gen.uniform(-1, 1, 20_000) * 2.0 ** gen.uniform(-20, 17, 20_000)).astype(np.float32)
    for values in (wide, near):
        got = quantize(torch.from_numpy(values.copy()), torch.tensor(1.0), fmt).view(
            torch.uint8).tolist()
        want = [fp8_byte(float(v), fmt) for v in values]
        bad = [(float(v), g, w) for v, g, w in zip(values, got, want, strict=True) if g != w]
        assert not bad, f"{len(bad)} differ, e.g. {bad[:5]}"
