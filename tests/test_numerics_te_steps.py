"""Twelve delayed-scaling training steps of an emulated layer, forward and backward, in float32,
bfloat16 and float16, with NaN, +-Inf, all-zero, -0.0, float32-denormal and near-overflow
inputs and gradients, on one rank and on two gloo ranks that see different amaxes: every cast's
scale and bytes, and the histories and scales after each step, against TE written here from its
sources (TE 2.20.0.dev0, d0067d0), sharing no code with foundry_fp8:

- a cast records `fmaxf(amax, |x|)` over the float32 elements (NaN skipped, Inf kept;
  transformer_engine/common/transpose/cast_transpose.cu:163-165) into row 0 of its history with
  `atomicMaxFloat` (common/util/vectorized_pointwise.h / cast_transpose.cu: the history's row 0
  is the quantizer's amax), and casts `OType(in * scale)` with the scale in force
  (cast_transpose.cu:163; the bytes: tests/test_numerics_te_cast.py's reference);
- a Linear casts its input (slot 0) and weight (slot 1) with the forward meta, the gradient of
  its output (slot 0) with the backward meta; HYBRID casts gradients to E5M2 (pytorch/
  quantization.py:281-296, `get_fp8_te_dtype`);
- the forward scales update when the outermost autocast exits with grad on (quantization.py:
  772-782), the backward ones at the end of the first module's backward (module/linear.py,
  `reduce_and_update_bwd_fp8_tensors`); row 0 is all-reduced (MAX) over the group first when
  the recipe says `reduce_amax` and the group has more than one rank (quantization.py:677-683);
- the update, per column (common/recipe/delayed_scaling.cu `kernel_bulk`, l. 176-250): the amax
  recorded is the reduced one unless that is 0 (l. 182-185); a recorded 0 leaves history and
  scale alone (l. 186); else the history rolls up by one, row 0 zeroed, the recorded amax in the
  last row (l. 187-198); the amax is fmaxf over the rolled window (`max`, l. 206-217) or the
  recorded one (`most_recent`, l. 203-205); the scale becomes `scaled_max / amax`, scaled_max =
  `fp8_max * 2**-margin` in float32 (l. 331), where that amax is finite and positive, else it
  is kept (l. 238-242), float32 max where the quotient overflows (l. 247-249). The first cast
  runs at scale 1 with a zero history (quantization.py, DelayedScalingRecipeState).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import foundry_fp8.emulate as emulate
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe
from tests.ranks import init_rank, run_ranks
from tests.test_numerics_te_cast import reference_cast

F32 = np.float32
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAXES = {"e4m3": 448.0, "e5m2": 57344.0}
IN_FEATURES, OUT_FEATURES, ROWS = 16, 8, 4


def _tiny(dtype: torch.dtype) -> float:
    """A magnitude whose scale overflows float32 where the dtype holds it (a float32 denormal),
    the smallest float16 subnormal otherwise (its scale is finite)."""
    return 1e-40 if dtype != torch.float16 else 2.0 ** -24


def _huge(dtype: torch.dtype) -> float:
    return 65504.0 if dtype == torch.float16 else 3.0e38


def _tensor(step: int, rank: int, kind: str, dtype: torch.dtype, shape: tuple[int, int]
            ) -> torch.Tensor:
    """The input or output gradient of a step: random, then bent by `kind`."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    t = torch.randn(*shape, generator=g) * (rank + 1)
    if kind == "zero":
        t.zero_()
    elif kind == "negzero":
        t = torch.full(shape, -0.0)
    elif kind == "nan":
        t[0, 1], t[2, 3] = math.nan, -math.nan
    elif kind == "inf":
        t[1, 0] = -math.inf
    elif kind == "tiny":
        t = t.sign() * _tiny(dtype)
    elif kind == "huge":
        t[0, 0] = _huge(dtype)
    elif kind == "ties":  # at scale 1 (a first step's), midpoints of E4M3's grid (1.0625,
        # 1.1875, 17, 3 * 2**-10: subnormal) and of E5M2's (1.125, 1.375, 3 * 2**-17)
        ties = [1.0625, -1.1875, 1.125, -1.375, 17.0, 3 * 2.0 ** -10, -3 * 2.0 ** -17, 0.5]
        t = torch.tensor([ties * (shape[1] // len(ties))] * shape[0])
    return t.to(dtype)


#: (input kind, gradient kind) per step, per rank
STEPS = {0: [("ties", "ties"), ("nan", "plain"), ("zero", "nan"), ("inf", "plain"),
             ("plain", "inf"), ("tiny", "tiny"), ("plain", "zero"), ("huge", "huge"),
             ("negzero", "negzero"), ("ties", "plain"), ("plain", "ties"), ("plain", "plain")],
         1: [("plain", "zero"), ("zero", "plain"), ("plain", "plain"), ("plain", "nan"),
             ("tiny", "plain"), ("plain", "plain"), ("inf", "plain"), ("plain", "plain"),
             ("plain", "tiny"), ("zero", "zero"), ("plain", "plain"), ("nan", "huge")]}


def fmaxf(a: float, b: float) -> float:
    """C's fmaxf: a NaN operand yields the other."""
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


def te_amax(t: torch.Tensor) -> float:
    amax = 0.0
    for v in t.detach().float().abs().reshape(-1).tolist():
        amax = fmaxf(amax, v)
    return amax


class Column:
    """One history column and its scale, as TE's kernel sees them (Python floats)."""

    def __init__(self, length: int):
        self.history, self.scale = [0.0] * length, 1.0

    def record(self, amax: float) -> None:
        self.history[0] = max(self.history[0], amax)  # atomicMaxFloat; amax is never NaN

    def update(self, fp8_max: float, algo: str, margin: int) -> None:
        last = self.history[0]
        if last == 0.0:
            return
        window = [*self.history[1:], last]
        amax = 0.0
        for a in window:
            amax = fmaxf(amax, a)
        if algo == "most_recent":
            amax = last
        self.history = [0.0, *window[1:]] if len(window) > 1 else [0.0]
        scaled_max = F32(fp8_max) * F32(2.0) ** F32(-margin)
        if math.isfinite(amax) and amax > 0:
            with np.errstate(over="ignore"):
                self.scale = float(scaled_max / F32(amax))
        if math.isinf(self.scale):
            self.scale = FLOAT32_MAX


def _cast_bytes(t: torch.Tensor, scale: float, fmt: str) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return reference_cast(t.detach().float().numpy() * F32(scale), fmt)


@contextmanager
def _recorded_casts() -> Iterator[list[tuple[str, float, np.ndarray]]]:
    """Every `quantize` the emulated layer calls, as (format, scale, bytes), while inside."""
    casts: list[tuple[str, float, np.ndarray]] = []
    original = emulate.quantize

    def recording(x, scale, fmt):
        q = original(x, scale, fmt)
        casts.append((fmt, float(torch.as_tensor(scale)), q.view(torch.uint8).numpy().copy()))
        return q

    emulate.quantize = recording
    try:
        yield casts
    finally:
        emulate.quantize = original


def _run(recipe: FP8Recipe, dtype: torch.dtype, rank: int, world: int) -> list[str]:
    """The emulated layer's 12 steps against the TE model; returns the mismatches found."""
    with _recorded_casts() as casts:
        return _steps(recipe, dtype, rank, world, casts)


def _steps(recipe: FP8Recipe, dtype: torch.dtype, rank: int, world: int,
           casts: list[tuple[str, float, np.ndarray]]) -> list[str]:
    torch.manual_seed(0)  # the same weight on every rank
    layer = EmulatedFP8Linear(IN_FEATURES, OUT_FEATURES, bias=False, dtype=dtype)
    fwd_fmt = "e4m3"
    bwd_fmt = "e5m2" if recipe.fp8_format == "HYBRID" else "e4m3"
    length, algo, margin = recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin
    cols = {"x": Column(length), "w": Column(length), "g": Column(length)}
    problems: list[str] = []
    for step in range(12):
        per_rank = [[_tensor(step, r, kind, dtype, shape) for kind, shape in
                     zip(STEPS[r][step], ((ROWS, IN_FEATURES), (ROWS, OUT_FEATURES)),
                         strict=True)] for r in range(world)]
        x, grad = per_rank[rank]
        casts.clear()
        with fp8_autocast(recipe=recipe):
            out = layer(x.requires_grad_(True))
        (out * grad).sum().backward()  # the output's gradient is `grad`, exactly
        layer.weight.grad = None
        # the TE model: the casts with the scales in force, then the updates
        want = [(fwd_fmt, cols["x"].scale, _cast_bytes(x, cols["x"].scale, fwd_fmt)),
                (fwd_fmt, cols["w"].scale, _cast_bytes(layer.weight, cols["w"].scale, fwd_fmt))]
        amaxes = {"x": max(te_amax(p[0]) for p in per_rank),
                  "w": te_amax(layer.weight)}
        if not recipe.reduce_amax:
            amaxes["x"] = te_amax(x)
        for key in ("x", "w"):
            cols[key].record(amaxes[key])
            cols[key].update(MAXES[fwd_fmt], algo, margin)
        want.append((bwd_fmt, cols["g"].scale, _cast_bytes(grad, cols["g"].scale, bwd_fmt)))
        cols["g"].record(max(te_amax(p[1]) for p in per_rank) if recipe.reduce_amax
                         else te_amax(grad))
        cols["g"].update(MAXES[bwd_fmt], algo, margin)
        if len(casts) != 3:
            problems.append(f"step {step}: {len(casts)} casts, want 3")
            continue
        for name, (fmt, scale, data), (want_fmt, want_scale, want_data) in zip(
                "xwg", casts, want, strict=True):
            if (fmt, scale) != (want_fmt, want_scale):
                problems.append(f"step {step} {name}: cast {fmt} at {scale!r}, "
                                f"TE {want_fmt} at {want_scale!r}")
            elif not np.array_equal(data.reshape(-1), want_data.reshape(-1)):
                problems.append(f"step {step} {name}: bytes differ at "
                                f"{np.flatnonzero(data.reshape(-1) != want_data.reshape(-1))}")
        fwd, bwd = layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"]
        got = {"x": (fwd.amax_history[:, 0].tolist(), fwd.scale[0].item()),
               "w": (fwd.amax_history[:, 1].tolist(), fwd.scale[1].item()),
               "g": (bwd.amax_history[:, 0].tolist(), bwd.scale[0].item())}
        for key, column in cols.items():
            if got[key] != (column.history, column.scale):
                problems.append(f"step {step} {key}: history/scale {got[key]}, "
                                f"TE {(column.history, column.scale)}")
        for meta, slots in ((fwd, (2,)), (bwd, (1,))):  # never cast: untouched
            for slot in slots:
                if meta.scale[slot].item() != 1.0 or meta.amax_history[:, slot].any():
                    problems.append(f"step {step}: unused slot {slot} changed")
    return problems


RECIPES = [
    FP8Recipe(fp8_format="HYBRID", amax_compute_algo="max", amax_history_len=4, margin=0),
    FP8Recipe(fp8_format="E4M3", amax_compute_algo="most_recent", amax_history_len=3, margin=1),
    FP8Recipe(fp8_format="HYBRID", amax_compute_algo="max", amax_history_len=1, margin=2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", RECIPES, ids=["hybrid-max-4", "e4m3-recent-3-m1",
                                                 "hybrid-max-1-m2"])
def test_twelve_steps_forward_and_backward_are_tes_byte_for_byte(recipe, dtype):
    assert _run(recipe, dtype, rank=0, world=1) == []


def _rank_worker(rank: int, rendezvous: str, out_dir: str) -> None:
    init_rank(rank, rendezvous)
    try:
        results = {}
        for reduce_amax in (True, False):
            for dtype in (torch.float32, torch.bfloat16):
                recipe = FP8Recipe(amax_history_len=4, reduce_amax=reduce_amax)
                results[f"{reduce_amax}-{dtype}"] = _run(recipe, dtype, rank, world=2)
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_with_different_amaxes_reduce_row_0_as_te(tmp_path):
    """Rank 0 and rank 1 see different inputs and gradients (zero on one rank while the other
    records, NaN, Inf, denormals): with `reduce_amax` both follow the MAX over ranks of row 0
    (a rank that recorded 0 still rolls, taking the other's amax), without it each its own."""
    run_ranks(_rank_worker, str(tmp_path))
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results == {f"{r}-{d}": [] for r in (True, False)
                           for d in (torch.float32, torch.bfloat16)}, rank


def te_current_scale(amax: float, fp8_max: float, power_2: bool) -> float:
    """`compute_scale_from_amax` (common/recipe/recipe_common.cuh:14-49) as TE's per-tensor
    current scaling calls it (common/recipe/current_scaling.cu:274-275: epsilon 0, float32 max
    for an overflowing quotient): 1 for an Inf, 0 or NaN amax; else `fp8_max / amax` in float32,
    float32 max where it overflows, then with `power_2` only its sign and exponent bits kept
    (`& 0xFF800000`, l. 39-46)."""
    if math.isinf(amax) or amax == 0 or math.isnan(amax):
        return 1.0
    with np.errstate(over="ignore"):
        scale = F32(fp8_max) / F32(amax)
    if np.isinf(scale):
        scale = F32(FLOAT32_MAX)
    if power_2:
        scale = (np.array([scale], dtype=np.float32).view(np.uint32) & 0xFF800000).view(
            np.float32)[0]
    return float(scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8_format", ["HYBRID", "E4M3"])
@pytest.mark.parametrize("power_2", [False, True])
def test_twelve_current_scaling_steps_are_tes_byte_for_byte(dtype, fp8_format, power_2):
    """Float8CurrentScaling: each cast's scale from its own tensor's amax (fmaxf: NaN skipped,
    Inf kept), no history; the same adversarial steps."""
    recipe = FP8Recipe(scaling="current", fp8_format=fp8_format, use_power_2_scales=power_2)
    bwd_fmt = "e5m2" if fp8_format == "HYBRID" else "e4m3"
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(IN_FEATURES, OUT_FEATURES, bias=False, dtype=dtype)
    problems = []
    with _recorded_casts() as casts:
        for step, (x_kind, g_kind) in enumerate(STEPS[0]):
            x = _tensor(step, 0, x_kind, dtype, (ROWS, IN_FEATURES))
            grad = _tensor(step, 0, g_kind, dtype, (ROWS, OUT_FEATURES))
            casts.clear()
            with fp8_autocast(recipe=recipe):
                out = layer(x.requires_grad_(True))
            (out * grad).sum().backward()
            want = []
            for t, fmt in ((x, "e4m3"), (layer.weight, "e4m3"), (grad, bwd_fmt)):
                scale = te_current_scale(te_amax(t), MAXES[fmt], power_2)
                want.append((fmt, scale, _cast_bytes(t, scale, fmt)))
            for name, got, ref in zip("xwg", casts, want, strict=True):
                if got[:2] != ref[:2] or not np.array_equal(got[2].reshape(-1),
                                                            ref[2].reshape(-1)):
                    problems.append(f"step {step} {name}: {got[:2]} TE {ref[:2]}")
    assert problems == []
