"""Random emulated Linear runs against TE's formulas written here from TE's sources, step by step.

Each case draws shapes (odd ones too), float32 or bfloat16, one or two chained layers with or
without bias, delayed scaling (history 1..1024, `max` / `most_recent`, margin 0..3) or current
scaling (power-of-2 scales or not), and several steps with NaN, +-Inf, all-zero and rescaled
inputs and output gradients. After every step the histories and scales must equal the model's
bit for bit, the FP8 values each GEMM reads must be the model's exactly (checked through the
GEMMs: see `_check_gemm`), and the outputs and gradients must be the exact product of those FP8
values within the float32 accumulation and the one rounding to the activation dtype.

The model, from TE v2.18 (same lines at d0067d0 unless said), shares no code with foundry_fp8:
- amax of a cast: `fmaxf(|x|, max)` over its float32 elements, NaN skipped, Inf kept
  (common/recipe/current_scaling.cu:39-61; common/util/vectorized_pointwise.h:199-207);
- the cast: `OType(x * scale)` in float32, RNE with saturation to the largest finite value
  (`__NV_SATFINITE`), NaN kept (vectorized_pointwise.h:202-206); `scale_inv = 1 / scale` rounded
  once (common/util/utils.cuh `__frcp_rn`);
- delayed: the amax goes into row 0 by atomicMax, the scale in force casts; the forward columns
  update when the outermost autocast exits, the backward ones at the end of the first layer's
  backward; the update is `kernel_bulk` (common/recipe/delayed_scaling.cu:162-253, scaled_max
  l. 331): a column whose row 0 is 0 is left alone; else it rolls up by one (row 0 zeroed, the
  recorded amax last), amax = fmaxf over the window (`max`) or the recorded one
  (`most_recent`), scale = scaled_max / amax where finite and positive, else kept, float32 max
  where the quotient overflows;
- current: `compute_scale_from_amax` (common/recipe/recipe_common.cuh:14-49) with epsilon 0 and
  float32 max for an overflowing quotient (current_scaling.cu:274-275): 1 for an Inf, NaN or
  zero amax; power of 2 by keeping the sign and exponent bits;
- a GEMM computes `scale_inv_a * scale_inv_b * sum(a_fp8 * b_fp8)` accumulating in float32 and
  rounds once to the activation dtype; bias in bfloat16 for float32 activations
  (pytorch/module/linear.py:454-459); bgrad the float32 sum of the high-precision gradient
  (module/base.py:1716, `bgrad_quantize`);
- TE's forward refuses an operand whose leading dims' product is no multiple of 8 or last dim
  no multiple of 16 (pytorch/utils.py:613-623, called at module/linear.py:336): the emulation
  must warn of exactly those and run them.
"""

from __future__ import annotations

import itertools
import math
import random
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import foundry_fp8.emulate as emulate
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe
from tests.test_numerics_te_current_scale import te_current_scale  # TE's kernel, one copy

F32 = np.float32
F32_MAX = F32(np.finfo(np.float32).max)
#: largest finite value, mantissa bits, smallest normal exponent (OCP FP8: E4M3 1.75 * 2**8,
#: E5M2 1.75 * 2**15)
FP8 = {"e4m3": (448.0, 3, -6), "e5m2": (57344.0, 2, -14)}
#: precision (bits, implicit one included) and smallest subnormal of each activation dtype
PRECISION = {torch.float32: (24, 2.0 ** -149), torch.bfloat16: (8, 2.0 ** -133)}


def fp8_values(scaled: np.ndarray, fmt: str) -> np.ndarray:
    """float32 `x * scale` -> the FP8 values (float64): RNE on the FP8 grid, saturated."""
    top, mbits, min_exp = FP8[fmt]
    a = np.abs(scaled.astype(np.float64))
    with np.errstate(invalid="ignore", over="ignore"):
        exponent = np.maximum(np.frexp(np.where(np.isfinite(a), a, 1.0))[1] - 1, min_exp)
        quantum = np.ldexp(1.0, exponent - mbits)
        q = np.minimum(np.round(a / quantum) * quantum, top)  # np.round: half to even
        q = np.where(np.isinf(a), top, q)
    return np.copysign(q, scaled)


def te_amax(t: np.ndarray) -> F32:
    finite_or_inf = np.abs(t[~np.isnan(t)])
    return F32(finite_or_inf.max()) if finite_or_inf.size else F32(0.0)


@dataclass
class Meta:
    """One layer's forward or backward scaling state as TE's kernels see it (float32)."""

    history: np.ndarray
    scale: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.scale = np.ones(self.history.shape[1], dtype=np.float32)

    def record(self, slot: int, amax: F32) -> None:
        self.history[0, slot] = max(self.history[0, slot], amax)  # atomicMaxFloat

    def update(self, fp8_max: float, algo: str, margin: int) -> None:
        """kernel_bulk, column by column (delayed_scaling.cu:176-250)."""
        length = self.history.shape[0]
        scaled_max = F32(fp8_max) * np.power(F32(2.0), F32(-margin))
        for c in range(self.history.shape[1]):
            last = self.history[0, c]
            amax = F32(0.0)
            if last != 0:
                column = self.history[:, c].copy()
                for i in range(length):
                    a = column[i + 1] if i < length - 1 else last
                    amax = np.fmax(amax, a)
                    self.history[i, c] = a if i > 0 else 0
            if algo == "most_recent":
                amax = last
            scale = self.scale[c]
            if np.isfinite(amax) and amax > 0:
                with np.errstate(over="ignore"):
                    scale = scaled_max / amax
            self.scale[c] = F32_MAX if np.isinf(scale) else scale


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


def _exact_gemm(a: np.ndarray, a_inv: F32, b: np.ndarray, b_inv: F32
                ) -> tuple[np.ndarray, np.ndarray]:
    """`a_inv * b_inv * a @ b.T` in float64 (exact: FP8 products need 8 bits, their sums of
    fewer than 2**17 terms stay within 53) and the sum of the terms' magnitudes."""
    factor = np.float64(a_inv) * np.float64(b_inv)
    with np.errstate(invalid="ignore", over="ignore"):
        return (a @ b.T) * factor, (np.abs(a) @ np.abs(b).T) * factor


def _check_close(name: str, got: torch.Tensor, exact: np.ndarray, magnitude: np.ndarray,
                 terms: int, problems: list[str]) -> None:
    """got (the activation dtype) against the exact value: float32 accumulation of `terms`
    products of float32-rounded operands (error below (terms + 4) * 2**-24 of the terms'
    magnitudes) and one rounding to the dtype (an ulp at most, after the float32 error)."""
    bits, smallest = PRECISION[got.dtype]
    g = got.detach().double().numpy().reshape(exact.shape)
    if not np.array_equal(np.isnan(g), np.isnan(exact)):
        problems.append(f"{name}: NaN at {np.argwhere(np.isnan(g) != np.isnan(exact))[:4]}")
        return
    with np.errstate(invalid="ignore"):
        accumulation = (terms + 4) * 2.0 ** -24 * magnitude
        tolerance = accumulation + np.maximum((np.abs(exact) + accumulation)
                                              * 2.0 ** (1 - bits), smallest)
        bad = ~np.isnan(exact) & ~((np.abs(g - exact) <= tolerance) | (g == exact))
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        problems.append(f"{name}: {int(bad.sum())} values off, e.g. at {i}: {g[i]!r} vs "
                        f"{exact[i]!r} (tolerance {tolerance[i]:.3g})")


@dataclass
class Case:
    seed: int
    dtype: torch.dtype
    recipe: FP8Recipe
    lead: tuple[int, ...]
    widths: list[int]  # in_features, then each layer's out_features
    bias: bool
    steps: int

    @classmethod
    def draw(cls, seed: int) -> Case:
        rng = random.Random(seed)
        if rng.random() < 0.5:
            recipe = FP8Recipe(
                fp8_format=rng.choice(["HYBRID", "E4M3"]),
                amax_history_len=rng.choice([1, 1, 2, 5, 1024]),
                amax_compute_algo=rng.choice(["max", "most_recent"]),
                margin=rng.choice([0, 1, 3]))
        else:
            recipe = FP8Recipe(scaling="current", fp8_format=rng.choice(["HYBRID", "E4M3"]),
                               use_power_2_scales=rng.random() < 0.5)

        def dim(top: int) -> int:
            return rng.choice([16, 32, 48]) if rng.random() < 0.5 else rng.randint(1, top)

        lead = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
        widths = [dim(40) for _ in range(rng.choice([2, 2, 3]))]
        return cls(seed, rng.choice([torch.float32, torch.bfloat16]), recipe, lead, widths,
                   rng.random() < 0.6, rng.randint(3, 6))


def _tensor(rng: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, kind: str
            ) -> torch.Tensor:
    t = torch.randn(shape, generator=rng) * 10.0 ** (torch.rand((), generator=rng) * 6 - 3)
    flat = t.view(-1)
    spot = int(torch.randint(flat.numel(), (), generator=rng))
    if kind == "zero":
        t.zero_()
    elif kind == "nan":
        flat[spot] = math.nan
    elif kind == "inf":
        flat[spot] = -math.inf if spot % 2 else math.inf
    return t.to(dtype)


KINDS = ["plain", "plain", "plain", "nan", "inf", "zero"]


def te_refuses(shape: tuple[int, ...]) -> bool:
    """assert_dim_for_fp8_exec (pytorch/utils.py:613-623)."""
    return math.prod(shape[:-1]) % 8 != 0 or shape[-1] % 16 != 0


def _run(case: Case) -> list[str]:
    recipe = case.recipe
    fmt_f = "e4m3"
    fmt_b = "e5m2" if recipe.fp8_format == "HYBRID" else "e4m3"
    delayed = recipe.scaling == "delayed"
    length = recipe.amax_history_len if delayed else 0
    torch.manual_seed(case.seed)
    layers = [EmulatedFP8Linear(i, o, bias=case.bias, dtype=case.dtype)
              for i, o in itertools.pairwise(case.widths)]
    if case.bias:
        with torch.no_grad():
            for layer in layers:
                layer.bias.normal_()
    ref = [(Meta(np.zeros((length, 3), F32)), Meta(np.zeros((length, 2), F32)))
           for _ in layers]
    rng = torch.Generator().manual_seed(case.seed)
    problems: list[str] = []

    def scale_for(meta: Meta, slot: int, t: np.ndarray, fmt: str) -> F32:
        amax = te_amax(t)
        if not delayed:
            return te_current_scale(amax, FP8[fmt][0], recipe.use_power_2_scales)
        meta.record(slot, amax)
        return meta.scale[slot]

    def cast(t: np.ndarray, scale: F32, fmt: str) -> tuple[np.ndarray, F32]:
        with np.errstate(invalid="ignore", over="ignore"):
            scaled = t.astype(np.float32) * scale
        return fp8_values(scaled, fmt), F32(1.0) / scale

    for step in range(case.steps):
        where = f"step {step}"
        x = _tensor(rng, (*case.lead, case.widths[0]), case.dtype,
                    KINDS[int(torch.randint(len(KINDS), (), generator=rng))])
        x.requires_grad_(True)
        if step and step % 2 == 0:  # the weights move, so their amaxes do
            with torch.no_grad():
                for layer in layers:
                    layer.weight.mul_(1.5).add_(torch.randn(layer.weight.shape, generator=rng)
                                                .to(case.dtype))
        emulate._WARNED.clear()
        inputs, outs = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fp8_autocast(recipe=recipe):
                h = x
                for layer in layers:
                    inputs.append(h)
                    h = layer(h)
                    h.retain_grad()
                    outs.append(h)
        refused = any(te_refuses(tuple(t.shape)) or te_refuses(tuple(layer.weight.shape))
                      for t, layer in zip(inputs, layers, strict=True))
        warned = any("TransformerEngine stops the forward" in str(w.message) for w in caught)
        if warned != refused:
            problems.append(f"{where}: TE refuses the forward: {refused}, warned: {warned}")
        grad = _tensor(rng, tuple(h.shape), case.dtype,
                       KINDS[int(torch.randint(len(KINDS), (), generator=rng))])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h.backward(grad)

        # the model, layer by layer, each given the tensors its layer met
        saved = []
        for n, (layer, (fwd, _)) in enumerate(zip(layers, ref, strict=True)):
            xin = _np(inputs[n]).reshape(-1, layer.in_features)
            w = _np(layer.weight)
            qx, x_inv = cast(xin, scale_for(fwd, 0, xin, fmt_f), fmt_f)
            qw, w_inv = cast(w, scale_for(fwd, 1, w, fmt_f), fmt_f)
            out, mag = _exact_gemm(qx, x_inv, qw, w_inv)
            if case.bias:
                bias = _np(layer.bias.to(torch.bfloat16 if case.dtype == torch.float32
                                         else case.dtype))
                out, mag = out + bias, mag + np.abs(bias)
            _check_close(f"{where} layer {n} output", outs[n], out, mag, layer.in_features,
                         problems)
            saved.append((qx, x_inv, qw, w_inv))
        if delayed:  # the outermost autocast's exit (grad on)
            for fwd, _ in ref:
                fwd.update(FP8[fmt_f][0], recipe.amax_compute_algo, recipe.margin)
        for n in reversed(range(len(layers))):
            layer, (_, bwd) = layers[n], ref[n]
            qx, x_inv, qw, w_inv = saved[n]
            g = _np(outs[n].grad).reshape(-1, layer.out_features)
            qg, g_inv = cast(g, scale_for(bwd, 0, g, fmt_b), fmt_b)
            dgrad, dmag = _exact_gemm(qg, g_inv, qw.T, w_inv)
            wgrad, wmag = _exact_gemm(qg.T, g_inv, qx.T, x_inv)
            grad_in = x.grad if n == 0 else outs[n - 1].grad
            _check_close(f"{where} layer {n} dgrad", grad_in, dgrad, dmag,
                         layer.out_features, problems)
            _check_close(f"{where} layer {n} wgrad", layer.weight.grad, wgrad, wmag,
                         g.shape[0], problems)
            if case.bias:
                with np.errstate(invalid="ignore", over="ignore"):
                    bgrad = g.astype(np.float64).sum(0)
                    bmag = np.abs(g.astype(np.float64)).sum(0)
                _check_close(f"{where} layer {n} bgrad", layer.bias.grad, bgrad, bmag,
                             g.shape[0], problems)
        if delayed:  # the end of the first layer's backward
            for _, bwd in ref:
                bwd.update(FP8[fmt_b][0], recipe.amax_compute_algo, recipe.margin)
        for n, layer in enumerate(layers):
            layer.zero_grad(set_to_none=True)
            if not delayed:
                continue
            for key, meta in zip(("scaling_fwd", "scaling_bwd"), ref[n], strict=True):
                got = layer.fp8_meta[key]
                if not (np.array_equal(got.amax_history.numpy(), meta.history, equal_nan=True)
                        and np.array_equal(got.scale.numpy(), meta.scale)):
                    problems.append(f"{where} layer {n} {key}: scale {got.scale.tolist()} "
                                    f"TE {meta.scale.tolist()}; history rows 0/-1 "
                                    f"{got.amax_history[[0, -1]].tolist()} TE "
                                    f"{meta.history[[0, -1]].tolist()}")
    return problems


@pytest.fixture(autouse=True)
def _own_warned(monkeypatch):
    """`_run` clears the emulation's once-per-run record at each step: on a copy of its own."""
    monkeypatch.setattr(emulate, "_WARNED", {})


@pytest.mark.parametrize("seed", range(80))
def test_random_linear_runs_follow_te_formulas(seed):
    case = Case.draw(seed)
    assert _run(case) == [], case


def test_the_model_tells_a_wrong_scale_from_a_right_one(monkeypatch):
    """The check is not blind: a scale update one ulp off (the reciprocal-times-product TE's
    fused kernel does not compute), or a cast that truncates instead of rounding to nearest,
    each make some drawn case fail."""
    import foundry_fp8.numerics as numerics

    def product_not_quotient(numerator, amax):
        return numerics._on(numerator, amax.device) * (1.0 / amax)

    monkeypatch.setattr(numerics, "_divide", product_not_quotient)
    assert any(_run(Case.draw(seed)) for seed in range(20))
    monkeypatch.undo()

    original = emulate.quantize

    def truncating(x, scale, fmt):
        q = original(x, scale, fmt)
        down = original(x.float() * 0.97, scale, fmt)  # one FP8 step lower for most elements
        return torch.where(torch.rand(q.shape) < 0.02, down, q)

    monkeypatch.setattr(emulate, "quantize", truncating)
    assert all(_run(Case.draw(seed)) for seed in range(6))
