"""The six places where the emulation parted from TransformerEngine 2.20 (issue 13), each against
a reference written here from TE's sources (file and line in each docstring; TE read at
2.20.0.dev0, commit d0067d0), on an input that showed the old difference."""

from __future__ import annotations

import ast
import gc
import subprocess
import sys

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe, RecipeError
from tests.ranks import init_rank, run_ranks

E4M3, E5M2 = 448.0, 57344.0
F32 = torch.float32


def te_scale(fp8_max: float, amax: float, margin: int = 0) -> float:
    """`fp8_max * 2**-margin / amax` divided once in float32 (`__fdiv_rn`,
    common/recipe/recipe_common.cuh:31, delayed_scaling.cu:239): the float64 quotient of two
    float32 numbers rounded to float32 is that division."""
    return float(torch.tensor(fp8_max * 2.0 ** -margin / float(torch.tensor(amax, dtype=F32)),
                              dtype=torch.float64).float())


def te_amax(x: torch.Tensor) -> float:
    """TE's amax: `fmaxf(fabsf(v), max)` from 0 over the elements (common/util/
    vectorized_pointwise.h:184-202, common/recipe/current_scaling.cu:55-60): fmaxf returns the
    other operand when one is NaN, so NaN elements are skipped; inf is a number like any."""
    result = 0.0
    for v in x.detach().double().flatten().tolist():
        if v == v:  # not NaN
            result = max(result, abs(v))
    return result


def fp8(x: torch.Tensor, scale: float, fp8_max: float) -> torch.Tensor:
    """The FP8 values a cast writes, as float64: x * scale saturated to the format's max
    (TE's casts saturate), rounded to nearest even on the FP8 grid by torch's float8 dtypes."""
    dtype = torch.float8_e4m3fn if fp8_max == E4M3 else torch.float8_e5m2
    scaled = (x.detach().float() * torch.tensor(scale, dtype=F32)).clamp(-fp8_max, fp8_max)
    return scaled.to(dtype).double()


# -- 1. NaN in a cast tensor -------------------------------------------------------------------

def test_nan_is_skipped_by_the_delayed_amax_and_inf_counts():
    """Delayed `most_recent`: a batch with one NaN records the finite amax, so the next scale is
    448 / finite amax, where recording NaN kept the old scale (the issue's 170.24 vs 361.03
    case; here 1.0 vs 448 / amax) and the next ordinary batch was cast with the wrong scale.
    An inf element is recorded as inf, and the fused update keeps the scale for a non-finite
    amax (delayed_scaling.cu:238-249)."""
    recipe = FP8Recipe(amax_history_len=2, amax_compute_algo="most_recent")
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(16, 8, bias=False)
    meta = layer.fp8_meta["scaling_fwd"]
    x = torch.randn(4, 16) * 3
    x[1, 5] = float("nan")
    with fp8_autocast(recipe=recipe):
        out = layer(x)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2, 3]]).any()
    finite = te_amax(x)
    assert finite == x[~torch.isnan(x)].abs().max().item()
    assert meta.amax_history[-1, 0].item() == finite
    assert meta.scale[0].item() == te_scale(E4M3, finite) != 1.0
    # the next ordinary batch is cast with 448 / finite amax (NaN recorded: scale 1)
    x2 = torch.randn(4, 16) * 5
    with fp8_autocast(recipe=recipe):
        out2 = layer(x2)
    w_scale = te_scale(E4M3, te_amax(layer.weight))
    want = fp8(x2, te_scale(E4M3, finite), E4M3) / te_scale(E4M3, finite) @ (
        fp8(layer.weight, w_scale, E4M3) / w_scale).t()
    torch.testing.assert_close(out2.double(), want, rtol=1e-6, atol=1e-6)
    # inf: recorded, scale kept
    scale_before = meta.scale[0].item()
    x3 = torch.randn(4, 16)
    x3[0, 0] = float("inf")
    with fp8_autocast(recipe=recipe):
        layer(x3)
    assert meta.amax_history[-1, 0].item() == float("inf")
    assert meta.scale[0].item() == scale_before


def test_nan_is_skipped_by_the_current_scaling_amax():
    """Current scaling: scale = 448 / finite amax (compute_scale_from_amax,
    recipe_common.cuh:14-41), so rows without NaN are cast as TE casts them; the old NaN amax
    fell back to scale 1 and those rows differed by 5-11 %. An inf amax gives scale 1
    (recipe_common.cuh:24-26)."""
    recipe = FP8Recipe(scaling="current")
    torch.manual_seed(1)
    layer = EmulatedFP8Linear(32, 8, bias=False)
    x = torch.randn(6, 32) * 0.02
    x[2, 3] = float("nan")
    with fp8_autocast(recipe=recipe):
        out = layer(x)
    sx, sw = te_scale(E4M3, te_amax(x)), te_scale(E4M3, te_amax(layer.weight))
    want = (fp8(x, sx, E4M3) / sx) @ (fp8(layer.weight, sw, E4M3) / sw).t()
    rows = [0, 1, 3, 4, 5]
    torch.testing.assert_close(out[rows].double(), want[rows], rtol=1e-6, atol=1e-7)
    old = (fp8(x, 1.0, E4M3)) @ (fp8(layer.weight, sw, E4M3) / sw).t()  # scale 1
    relative = (old[rows] - want[rows]).norm(dim=1) / want[rows].norm(dim=1)
    assert (relative > 0.01).all()  # 2-11 % per row
    x[2, 3] = float("inf")
    with fp8_autocast(recipe=recipe):
        out = layer(x)
    want = fp8(x, 1.0, E4M3) @ (fp8(layer.weight, sw, E4M3) / sw).t()
    torch.testing.assert_close(out[rows].double(), want[rows], rtol=1e-6, atol=1e-7)


# -- 2. bf16 models: FP8 operands, float32 accumulation, one rounding ---------------------------

def _bf16_reference(x, weight, bias, grad, sx, sw, sg):
    """TE's FP8 GEMMs (general_gemm with out_dtype=activation_dtype, pytorch/module/
    linear.py:536-545 fprop, 1086-1095 dgrad, 1249-1265 wgrad): the products of the FP8 values
    accumulated at high precision (float64 here) times the inverse scales, the bias (in the
    activation dtype, linear.py:499-502) added in the epilogue, the result rounded once to
    bfloat16; the bias gradient reduces the high-precision gradient (bgrad_quantize)."""
    qx, qw, qg = fp8(x, sx, E4M3) / sx, fp8(weight, sw, E4M3) / sw, fp8(grad, sg, E5M2) / sg
    out = (qx @ qw.t() + bias.double()).to(torch.bfloat16)
    dgrad = (qg @ qw).to(torch.bfloat16)
    wgrad = (qg.t() @ qx).to(torch.bfloat16)
    bgrad = grad.double().sum(0).to(torch.bfloat16)
    return out, dgrad, wgrad, bgrad


def _rounding_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where got is not want's bfloat16 rounding up to float32 accumulation: more than one
    bfloat16 step apart, and further apart than float32 accumulation error (2**-20 of the
    largest |want|; it matters where a sum cancels to a value far below its terms)."""
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    error = (got.double() - want.double()).abs()
    return (steps > 1) & (error > 2.0 ** -20 * want.double().abs().max())


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_bf16_layer_multiplies_fp8_values_in_float32_and_rounds_once(scaling):
    """Forward, dgrad, wgrad and bias gradient of a bfloat16 layer equal the float64 reference
    rounded once to bfloat16, except where float32 accumulation lands on the other side of a
    bfloat16 rounding boundary (at most one step, on a handful of elements); the old path
    (operands rounded to bfloat16, GEMM in bfloat16) differed on a third of them."""
    torch.manual_seed(2)
    layer = EmulatedFP8Linear(256, 128, dtype=torch.bfloat16)
    x = (torch.randn(64, 256) * 2).to(torch.bfloat16).requires_grad_()
    grad = (torch.randn(64, 128) * 1e-2).to(torch.bfloat16)
    recipe = FP8Recipe(scaling=scaling)
    if scaling == "delayed":  # a first step, so that the scales in force are not 1
        with fp8_autocast(recipe=recipe):
            layer(x * 0.7).backward(grad * 3)
        x.grad = layer.weight.grad = layer.bias.grad = None
        sx, sw = layer.fp8_meta["scaling_fwd"].scale[:2].tolist()
        sg = layer.fp8_meta["scaling_bwd"].scale[0].item()
        assert sg == te_scale(E5M2, te_amax(grad * 3))
    else:
        sx, sw = te_scale(E4M3, te_amax(x)), te_scale(E4M3, te_amax(layer.weight))
        sg = te_scale(E5M2, te_amax(grad))
    with fp8_autocast(recipe=recipe):
        out = layer(x)
    out.backward(grad)
    want = _bf16_reference(x, layer.weight, layer.bias, grad, sx, sw, sg)
    got = out, x.grad, layer.weight.grad, layer.bias.grad
    assert all(t.dtype == torch.bfloat16 for t in got)
    for name, g, w in zip(("out", "dgrad", "wgrad", "bgrad"), got, want, strict=True):
        assert not _rounding_apart(g.detach(), w).any(), name
        assert (g != w).float().mean() < 0.01, name
    # the old path, on the same input
    qx = (fp8(x, sx, E4M3) / sx).to(torch.bfloat16)
    qw = (fp8(layer.weight, sw, E4M3) / sw).to(torch.bfloat16)
    old = nn.functional.linear(qx, qw, layer.bias.detach())
    assert (old != want[0]).float().mean() > 0.2


def test_float32_weights_under_torch_autocast_compute_in_the_autocast_dtype():
    """Under torch autocast TE's activation dtype is autocast's (module/base.py:1482-1487); it
    casts the float32 input and weight to FP8 directly (linear.py:425-435, 480-490) and writes
    bfloat16; gradients come back in the parameters' dtype."""
    torch.manual_seed(3)
    layer = EmulatedFP8Linear(64, 32)
    x = torch.randn(8, 64, requires_grad=True)
    recipe = FP8Recipe(scaling="current")
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8_autocast(recipe=recipe):
        out = layer(x)
    sx, sw = te_scale(E4M3, te_amax(x)), te_scale(E4M3, te_amax(layer.weight))
    bias = layer.bias.detach().to(torch.bfloat16)
    want = ((fp8(x, sx, E4M3) / sx) @ (fp8(layer.weight, sw, E4M3) / sw).t()
            + bias.double()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert not _rounding_apart(out.detach(), want).any()
    out.float().sum().backward()
    assert x.grad.dtype == layer.weight.grad.dtype == layer.bias.grad.dtype == F32


# -- 3. reduce_amax across ranks ----------------------------------------------------------------

def _rank_input(rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(10 + rank)) * 10 ** rank


def _reduce_worker(rank: int, rendezvous: str, out_dir: str) -> None:
    init_rank(rank, rendezvous)
    try:
        own = [torch_dist.new_group([r]) for r in range(2)]  # every rank creates every group
        results = {}
        cases = {"world": (True, None), "off": (False, None), "explicit": (True, "pair"),
                 "own": (True, "own")}
        pair = torch_dist.new_group([0, 1])
        for name, (reduce_amax, group) in cases.items():
            torch.manual_seed(0)
            layer = EmulatedFP8Linear(16, 16)
            x = _rank_input(rank).requires_grad_()
            group = {"pair": pair, "own": own[rank], None: None}[group]
            with fp8_autocast(recipe=FP8Recipe(amax_history_len=4, reduce_amax=reduce_amax),
                              amax_reduction_group=group):
                out = layer(x)
            (out * (rank + 1)).sum().backward()
            results[name] = {k: v.clone() for k, v in
                             (("fwd", layer.fp8_meta["scaling_fwd"].scale),
                              ("bwd", layer.fp8_meta["scaling_bwd"].scale),
                              ("fwd_history", layer.fp8_meta["scaling_fwd"].amax_history))}
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        torch_dist.destroy_process_group()


def test_reduce_amax_all_reduces_row_0_across_the_group(tmp_path):
    """TE's reduce_and_update_fp8_tensors (pytorch/quantization.py:655-711): with `reduce_amax`,
    row 0 of every registered history is all-reduced (MAX) across the autocast's amax
    reduction group (the world group when None) before the fused update, so both ranks get
    448 / max(amax of rank 0, amax of rank 1) for inputs 10x apart (the issue's 109.23 vs
    10.92 case); without it, or with a one-rank group, each rank keeps its own."""
    run_ranks(_reduce_worker, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    amaxes = [te_amax(_rank_input(r)) for r in range(2)]
    grad_amaxes = [float(r + 1) for r in range(2)]  # d(out * (rank + 1)).sum() / d out
    for name in ("world", "explicit"):
        for result in results:
            assert result[name]["fwd"][0].item() == te_scale(E4M3, max(amaxes))
            assert result[name]["bwd"][0].item() == te_scale(E5M2, max(grad_amaxes))
            assert result[name]["fwd_history"][-1, 0].item() == max(amaxes)
    for name in ("off", "own"):
        for rank, result in enumerate(results):
            assert result[name]["fwd"][0].item() == te_scale(E4M3, amaxes[rank])
            assert result[name]["bwd"][0].item() == te_scale(E5M2, grad_amaxes[rank])
    assert te_scale(E4M3, amaxes[0]) != te_scale(E4M3, amaxes[1])


def _freed_worker(rank: int, rendezvous: str, out_dir: str) -> None:
    """Rank 1 leaves its first layer in a reference cycle the collector has not reached (as an
    exception's traceback can); rank 0 frees it at once. The second layer's steps all-reduce
    on both ranks alike."""
    init_rank(rank, rendezvous)
    gc.disable()
    try:
        recipe = FP8Recipe(amax_history_len=4)
        old = EmulatedFP8Linear(16, 16)
        with fp8_autocast(recipe=recipe):
            old(_rank_input(rank)).sum().backward()
        if rank == 1:
            cycle: list = [old]
            cycle.append(cycle)
            del cycle
        del old
        layer = EmulatedFP8Linear(16, 16)
        for _ in range(2):
            with fp8_autocast(recipe=recipe):
                out = layer(_rank_input(rank))
            out.sum().backward()
        torch.save(layer.fp8_meta["scaling_fwd"].amax_history.clone(), f"{out_dir}/rank{rank}.pt")
    finally:
        gc.enable()
        torch_dist.destroy_process_group()


def test_a_layer_freed_at_different_moments_on_each_rank_leaves_the_reduction_alike(tmp_path):
    """The emulation holds its layers weakly; a freed layer used to leave the all-reduce as soon
    as the garbage collector reached it, at different moments per rank, and the ranks then
    all-reduced different sizes (gloo: `op.preamble.length <= op.nbytes`). Both ranks now get
    the MAX over ranks of the live layer's amaxes in their history."""
    run_ranks(_freed_worker, str(tmp_path))
    histories = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    amax = max(te_amax(_rank_input(r)) for r in range(2))
    for history in histories:
        assert history[:, 0].tolist() == [0.0, 0.0, amax, amax]  # TE rolls row 0 to the end


# -- 4. backward update timing ------------------------------------------------------------------

def test_backward_scales_update_at_the_end_of_each_first_modules_backward():
    """Two autocast forwards of one layer (the second reads the first's output), one backward.
    TE flags the first FP8 module of each outermost autocast (is_first_fp8_module,
    quantization.py:754-755, taken in linear.py:258-265, 1436-1444) and updates the backward
    scales at the end of that module's backward (linear.py:1462-1470): the second forward's
    backward updates first, so the first forward's gradient is cast with the new scale
    (saturating) and the history ends [0, 0, amax2, amax1]; one update at the end of the whole
    backward gave [0, 0, 0, max] and a weight gradient many times off."""
    torch.manual_seed(4)
    recipe = FP8Recipe(amax_history_len=4)
    layer = EmulatedFP8Linear(16, 16, bias=False)
    with torch.no_grad():
        layer.weight.mul_(40)
    x = torch.randn(8, 16)
    grad = torch.randn(8, 16) * 0.01
    with fp8_autocast(recipe=recipe):
        h = layer(x)
    with fp8_autocast(recipe=recipe):
        y = layer(h)
    y.backward(grad)

    # TE by hand, float64: forward scales after each outermost exit, backward as described
    w = layer.weight.detach()
    sx = 1.0  # the scales in force at the first forward
    sh, sw2 = te_scale(E4M3, te_amax(x)), te_scale(E4M3, te_amax(w))
    qx, qh = fp8(x, sx, E4M3) / sx, fp8(h, sh, E4M3) / sh
    qw2 = fp8(w, sw2, E4M3) / sw2
    g2 = fp8(grad, 1.0, E5M2)  # backward scale 1 in force
    dh = (g2 @ qw2).float()
    wgrad = g2.t() @ qh
    sg = te_scale(E5M2, te_amax(grad))  # updated at the end of the second forward's backward
    g1 = fp8(dh, sg, E5M2) / sg
    wgrad = wgrad + g1.t() @ qx
    history = layer.fp8_meta["scaling_bwd"].amax_history[:, 0].tolist()
    assert history[:3] == [0.0, 0.0, te_amax(grad)]  # [0, 0, 0, max] with the old timing
    assert history[3] == pytest.approx(te_amax(dh), rel=1e-6)  # float32 vs float64 GEMM
    assert layer.fp8_meta["scaling_bwd"].scale[0].item() == pytest.approx(
        te_scale(E5M2, max(te_amax(grad), te_amax(dh))), rel=1e-6)
    torch.testing.assert_close(layer.weight.grad.double(), wgrad, rtol=1e-5, atol=1e-6)
    old = g2.t() @ qh + fp8(dh, 1.0, E5M2).t() @ qx  # the old timing: scale 1 for both
    assert (old - wgrad).norm() > 2 * wgrad.norm()
    assert te_amax(dh) > 2 * te_amax(grad)  # the first forward's gradient really saturated


# -- 5. a recipe change mid-run ----------------------------------------------------------------

def test_recipe_change_is_refused_with_one_line_naming_the_key():
    """TE keeps a layer on the recipe it first registered under (module/base.py:1106-1117
    reuses the delayed state, only adjusting the history length; quantization.py:519-524
    registers it once, with that recipe): margin 0 -> 2 gave TE 24.47 where we followed the
    new margin (6.12). The emulation refuses such a change, and changes nothing doing so
    (`amax_compute_algo` aside, which TE takes from the last recipe entered:
    tests/test_emulate_modes.py)."""
    torch.manual_seed(5)
    layer = EmulatedFP8Linear(16, 8)
    x = torch.randn(4, 16)
    with fp8_autocast(recipe=FP8Recipe(amax_history_len=4)):
        layer(x)
    state = [t.clone() for meta in layer.fp8_meta.values() for t in (meta.scale, meta.amax_history)]
    for change, key in ((dict(margin=2), "margin"), (dict(fp8_format="E4M3"), "fp8_format"),
                        (dict(reduce_amax=False), "reduce_amax")):
        with pytest.raises(RecipeError) as error:
            with fp8_autocast(recipe=FP8Recipe(amax_history_len=4, **change)):
                layer(x)
        message = str(error.value)
        assert message.startswith(f"fp8_recipe.{key}: ") and "\n" not in message
    with pytest.raises(RecipeError, match=r"^fp8_recipe\.scaling: "):
        with fp8_autocast(recipe=FP8Recipe(scaling="current")):
            layer(x)
    after = [t for meta in layer.fp8_meta.values() for t in (meta.scale, meta.amax_history)]
    assert all(torch.equal(a, b) for a, b in zip(state, after, strict=True))
    with fp8_autocast(recipe=FP8Recipe(amax_history_len=8)):  # TE follows the length
        layer(x)
    layer.reset_scaling_state()  # a fresh layer may take any recipe
    with fp8_autocast(recipe=FP8Recipe(margin=2)):
        layer(x)
    assert layer.fp8_meta["scaling_fwd"].scale[0].item() == te_scale(E4M3, te_amax(x), margin=2)


# -- 6. empty input ----------------------------------------------------------------------------

@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_empty_input_records_no_amax_and_raises_nothing(scaling):
    """TE casts nothing for an empty tensor (Float8Quantizer::quantize and the current-scaling
    quantizer return at numel 0, pytorch/csrc/quantizer.cpp:632-635, 990-997) and a GEMM with an
    empty operand writes zeros (pytorch/csrc/extensions/gemm.cpp:535-541): no input or
    gradient amax, a zero weight and bias gradient. The weight is cast as on every forward
    (linear.py:455-490), so its slot records as usual."""
    recipe = FP8Recipe(amax_history_len=4) if scaling == "delayed" else FP8Recipe(scaling=scaling)
    torch.manual_seed(6)
    layer = EmulatedFP8Linear(16, 8)
    with fp8_autocast(recipe=recipe):
        layer(torch.randn(3, 16)).sum().backward()
    before = {k: (m.scale.clone(), m.amax_history.clone()) for k, m in layer.fp8_meta.items()}
    layer.zero_grad()
    x = torch.zeros(2, 0, 16, requires_grad=True)
    with fp8_autocast(recipe=recipe):
        out = layer(x)
    out.sum().backward()
    assert out.shape == (2, 0, 8)
    assert torch.equal(layer.weight.grad, torch.zeros(8, 16))
    assert torch.equal(layer.bias.grad, torch.zeros(8))
    fwd, bwd = layer.fp8_meta["scaling_fwd"], layer.fp8_meta["scaling_bwd"]
    assert torch.equal(bwd.scale, before["scaling_bwd"][0])
    assert torch.equal(bwd.amax_history, before["scaling_bwd"][1])
    assert fwd.scale[0] == before["scaling_fwd"][0][0]
    assert torch.equal(fwd.amax_history[:, 0], before["scaling_fwd"][1][:, 0])
    if scaling == "delayed":
        assert fwd.amax_history[-1, 1].item() == te_amax(layer.weight)
    fresh = EmulatedFP8Linear(16, 8)  # an empty first batch: nothing recorded, no error
    with fp8_autocast(recipe=recipe):
        fresh(torch.zeros(0, 16))
    assert not fresh.fp8_meta["scaling_fwd"].amax_history[:, 0].any()


# -- the public names ---------------------------------------------------------------------------

def test_public_names_load_lazily_from_the_package():
    names = ["EmulatedFP8Linear", "fp8_autocast", "fp8_checkpoint", "FP8Recipe",
             "quantize_dequantize", "current_scale", "delayed_scale_update"]
    code = ("import sys, foundry_fp8; print('torch' in sys.modules); "
            f"objs = [getattr(foundry_fp8, n) for n in {names!r}]; "
            "print(all(n in foundry_fp8.__all__ for n in " + repr(names) + ")); "
            "print([o.__module__ for o in objs])")
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert lines[0] == "False" and lines[1] == "True"
    assert ast.literal_eval(lines[2]) == ["foundry_fp8.emulate"] * 3 + ["foundry_fp8.recipe"] + [
        "foundry_fp8.numerics"] * 3
