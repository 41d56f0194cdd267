"""TransformerEngine's own delayed- and current-scaling tests, ported to the emulated backend.

Each test names the TE test it ports (TE git tag and file:line; the lines are the same at v2.18
and at 2.20.0.dev0 unless both are given). The setup is TE's (sizes, values, margin, history
lengths, the in-place tweaks of `fp8_meta`); the expected values are computed by the formula
TE's test writes, never from foundry_fp8's output; the tolerances are TE's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as torch_dist

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.numerics import current_scale, delayed_scale_update, quantize, scale_inverse
from foundry_fp8.recipe import FP8Recipe, RecipeError
from tests.ranks import init_rank, run_ranks

#: TE's `Format.HYBRID.value.max_fwd` / `.max_bwd` (common/recipe/__init__.py `_FormatHelper`)
MAX_FWD, MAX_BWD = 448.0, 57344.0
FP32_MAX = torch.finfo(torch.float32).max
#: tests/pytorch/utils.py:103-104 (`dtype_tols(float8_e4m3fn)`), what
#: `quantization_tols("fp8_delayed_scaling")` returns (utils.py:110-121)
FP8_DELAYED_TOLS = dict(rtol=0.125, atol=0.0675)


def _metas(module: EmulatedFP8Linear) -> tuple[torch.Tensor, ...]:
    """(fwd history, fwd scale, bwd history, bwd scale), the tensors themselves, as TE's test
    holds `fp8_meta[key].amax_history` / `.scale` across a step."""
    fwd, bwd = module.fp8_meta["scaling_fwd"], module.fp8_meta["scaling_bwd"]
    return fwd.amax_history, fwd.scale, bwd.amax_history, bwd.scale


# -- tests/pytorch/test_recipe.py:74-189, TestFP8Recipe.test_fp8_scale_update_with_linear_module

@pytest.mark.parametrize("amax_history_len", [31, 1024])
@pytest.mark.parametrize("amax_compute_algo", ["max", "most_recent"])
@pytest.mark.parametrize("is_first_microbatch", [None, True, False])
def test_te_recipe_scale_update_with_linear_module(amax_history_len, amax_compute_algo,
                                                   is_first_microbatch, margin=2):
    """TE holds the meta tensors of a Linear across a step, writes random histories and scales
    into them in place, and expects the step's fused update in those same tensors: the input
    and grad-output columns rolled, the weight's only when the weight was cast (not when
    `is_first_microbatch=False` reuses the cached FP8 weight), and scales
    `(fp8_max / amax) / 2**margin` (l. 137-138, 170-171)."""
    torch.manual_seed(1234)
    recipe = FP8Recipe(margin=margin, fp8_format="HYBRID", amax_history_len=amax_history_len,
                       amax_compute_algo=amax_compute_algo)
    with fp8_autocast(recipe=recipe):
        module = EmulatedFP8Linear(16, 16)
        y = module(torch.randn(16, 16), is_first_microbatch=True)
    y.backward(torch.zeros_like(y))

    amax_history_forward, scale_forward, amax_history_backward, scale_backward = _metas(module)
    # l. 110-114: tweak amax history and scaling factors, in place
    amax_history_forward.copy_(2 * torch.rand_like(amax_history_forward) + 0.5)
    amax_history_forward[0, :].zero_()
    scale_forward.copy_(2 * torch.rand_like(scale_forward) + 0.5)
    amax_history_backward[0, :].zero_()

    # l. 118-126: the expected histories
    update_weight_amax = is_first_microbatch is None or is_first_microbatch
    ref_amax_history_forward = amax_history_forward.clone()
    ref_amax_history_forward[:, 0].copy_(torch.roll(amax_history_forward[:, 0], -1))
    if update_weight_amax:
        ref_amax_history_forward[:, 1].copy_(torch.roll(amax_history_forward[:, 1], -1))
    ref_amax_history_forward[0, :].zero_()
    ref_amax_history_backward = amax_history_backward.clone()
    ref_amax_history_backward[:, 0].copy_(torch.roll(amax_history_backward[:, 0], -1))
    ref_amax_history_backward[0, :].zero_()
    kept_weight_scale = scale_forward[1].clone()

    with fp8_autocast(recipe=recipe):
        x = torch.randn(16, 16)
        y = module(x, is_first_microbatch=is_first_microbatch)
    y.backward(torch.randn_like(y))

    # l. 152-159: the held tensors hold the update (the last row is the step's own amax)
    torch.testing.assert_close(amax_history_forward[:-1], ref_amax_history_forward[:-1])
    torch.testing.assert_close(amax_history_backward[:-1], ref_amax_history_backward[:-1])
    # l. 162-189
    if amax_compute_algo == "max":
        ref_amax_forward = amax_history_forward.max(dim=0).values
        ref_amax_backward = amax_history_backward.max(dim=0).values
    else:
        ref_amax_forward = amax_history_forward[-1]
        ref_amax_backward = amax_history_backward[-1]
    ref_scale_forward = (MAX_FWD / ref_amax_forward) / (2**margin)
    ref_scale_backward = (MAX_BWD / ref_amax_backward) / (2**margin)
    torch.testing.assert_close(scale_forward[0], ref_scale_forward[0])
    if update_weight_amax:
        torch.testing.assert_close(scale_forward[1], ref_scale_forward[1])
    else:  # not asserted by TE: its fused kernel leaves a column that recorded nothing alone
        assert torch.equal(scale_forward[1], kept_weight_scale)
    torch.testing.assert_close(scale_backward[0], ref_scale_backward[0])
    # and the module reads the same tensors: the next cast uses the updated scale
    assert module.fp8_meta["scaling_fwd"].scale is scale_forward


# -- tests/pytorch/test_recipe.py:191-306, test_fp8_scale_update_with_linear_fuser_op (TE's
# BasicLinear op; the Linear module's delayed scaling is the same quantizer state)

@pytest.mark.parametrize("amax_history_len", [31, 1024])
@pytest.mark.parametrize("amax_compute_algo", ["max", "most_recent"])
def test_te_recipe_scale_update_over_four_steps_of_constant_tensors(
        amax_history_len, amax_compute_algo, margin=2, num_steps=4):
    """x, w and dy filled with step + 0.25 / 0.5 / 0.75: after each step the history's last
    step + 1 rows are exactly those amaxes (rtol=atol=0, l. 273-278) and the scale is
    `(max_val / amax) / 2**margin`, amax the largest so far or the last (l. 265-291)."""
    recipe = FP8Recipe(margin=margin, fp8_format="HYBRID", amax_history_len=amax_history_len,
                       amax_compute_algo=amax_compute_algo)
    op = EmulatedFP8Linear(16, 16)
    histories: dict[str, list[float]] = {"x": [], "w": [], "dy": []}
    for step in range(num_steps):
        histories["x"].append(step + 0.25)
        histories["w"].append(step + 0.5)
        histories["dy"].append(step + 0.75)
        x = torch.full((16, 16), histories["x"][-1], requires_grad=True)
        dy = torch.full((16, 16), histories["dy"][-1])
        with torch.no_grad():
            op.weight.fill_(histories["w"][-1])
        with fp8_autocast(recipe=recipe):
            y = op(x)
        y.backward(dy)

        fwd, bwd = op.fp8_meta["scaling_fwd"], op.fp8_meta["scaling_bwd"]
        checks = (("x", fwd.scale[0], fwd.amax_history[:, 0], MAX_FWD),
                  ("w", fwd.scale[1], fwd.amax_history[:, 1], MAX_FWD),
                  ("dy", bwd.scale[0], bwd.amax_history[:, 0], MAX_BWD))
        for name, test_scale, test_history, max_val in checks:
            ref_list = histories[name]
            if len(ref_list) > amax_history_len:
                ref_list = ref_list[-(amax_history_len + 1):]
            ref_amax = max(ref_list) if amax_compute_algo == "max" else ref_list[-1]
            torch.testing.assert_close(test_history[-(step + 1):],
                                       torch.tensor(ref_list)[:step + 1], rtol=0, atol=0)
            torch.testing.assert_close(test_scale.item(), (max_val / ref_amax) / (2**margin))


# -- tests/pytorch/test_recipe.py:308-404, test_scale_update_numeric_scenarios

def _scenario_amax(case: str, fp8_max: float) -> torch.Tensor:
    if case == "zero":
        return torch.tensor(0.0)
    if case == "tiny":  # l. 361-364: half the smallest amax whose scale is finite in float32
        return (fp8_max / torch.tensor(FP32_MAX)) / 2
    if case == "normal":  # l. 372
        return torch.rand(1, generator=torch.Generator().manual_seed(7))[0] + 1e-5
    return torch.tensor(float(case))


@pytest.mark.parametrize("amax_case", ["zero", "tiny", "normal", "inf", "nan"])
@pytest.mark.parametrize("fp8_max", [MAX_FWD, MAX_BWD], ids=["E4M3", "E5M2"])
def test_te_recipe_scale_update_numeric_scenarios(amax_case, fp8_max):
    """A one-row history holding the amax, scale 1, the fused update
    (`fused_amax_and_scale_update_after_reduction`, l. 386-394, margin 0): 1 for a zero, Inf or
    NaN amax (l. 358, 379, 384), float32 max where `fp8_max / amax` overflows (l. 369),
    `fp8_max / amax` otherwise (l. 374)."""
    amax = _scenario_amax(amax_case, fp8_max)
    expected = {"zero": 1.0, "tiny": FP32_MAX, "inf": 1.0, "nan": 1.0}.get(amax_case)
    if expected is None:
        expected = fp8_max / amax
    _, scale = delayed_scale_update(amax.reshape(1, 1), torch.ones(1), fp8_max, "max", 0)
    torch.testing.assert_close(scale, torch.as_tensor(expected, dtype=torch.float32).reshape(1))


# -- tests/pytorch/test_fusible_ops.py:979-1063 (v2.18: 444-528), TestFuser.test_fp8_scale_update

def test_te_fuser_fp8_scale_update_three_steps():
    """margin 2, HYBRID, history 8, max; w 2, 5, 3 (then 11), x 7, 3, 5, dy 1, 2, 1 on a 16x16
    Linear without bias: y and dx within FP8 tolerance of `w * x * size` and `w * dy * size`
    (l. 1038-1049), scales `(max / largest amax so far) / 2**margin` (l. 1052-1063)."""
    margin, size = 2, 16
    recipe = FP8Recipe(margin=margin, fp8_format="HYBRID", amax_history_len=8,
                       amax_compute_algo="max")
    model = EmulatedFP8Linear(size, size, bias=False)
    w_vals, x_vals, dy_vals = [2, 5, 3, 11], [7, 3, 5], [1, 2, 1]
    with torch.no_grad():
        model.weight.fill_(w_vals[0])
    for step in range(3):
        x = torch.full((size, size), float(x_vals[step]), requires_grad=True)
        dy = torch.full((size, size), float(dy_vals[step]))
        with fp8_autocast(recipe=recipe):
            y = model(x)
        y.backward(dy)
        with torch.no_grad():
            model.weight.fill_(w_vals[step + 1])

        torch.testing.assert_close(y, torch.full_like(y, w_vals[step] * x_vals[step] * size),
                                   **FP8_DELAYED_TOLS)
        torch.testing.assert_close(x.grad,
                                   torch.full_like(x.grad, w_vals[step] * dy_vals[step] * size),
                                   **FP8_DELAYED_TOLS)
        fwd, bwd = model.fp8_meta["scaling_fwd"], model.fp8_meta["scaling_bwd"]
        for test, vals, max_val in ((fwd.scale[1], w_vals, MAX_FWD),
                                    (fwd.scale[0], x_vals, MAX_FWD),
                                    (bwd.scale[0], dy_vals, MAX_BWD)):
            ref = (max_val / max(vals[:step + 1])) / (2**margin)
            torch.testing.assert_close(test, torch.full_like(test, ref))


# -- tests/pytorch/distributed/test_fusible_ops.py:835-946, _test_fp8_scale_update

def _tp_worker(rank: int, rendezvous: str, out_dir: str) -> None:
    """One rank of TE's tensor-parallel scale test, in both of its modes: this rank's shard of
    w (and of dy for `column`, of x for `row`), one step under the default `reduce_amax`."""
    init_rank(rank, rendezvous)
    try:
        results = {}
        for mode in ("column", "row"):
            x, w, dy = _tp_tensors()
            shard = slice(rank * 32, (rank + 1) * 32)
            if mode == "column":
                w, dy = w[shard, :], dy[..., shard].clone()
            else:
                w, x = w[:, shard], x[..., shard].clone()
            op = EmulatedFP8Linear(w.shape[1], w.shape[0], bias=False)
            with torch.no_grad():
                op.weight.copy_(w)
            recipe = FP8Recipe(margin=2, fp8_format="HYBRID", amax_history_len=31,
                               amax_compute_algo="max")
            with fp8_autocast(recipe=recipe):
                y = op(x.requires_grad_())
            y.backward(dy)
            fwd, bwd = op.fp8_meta["scaling_fwd"], op.fp8_meta["scaling_bwd"]
            results[mode] = {"x": fwd.scale[0].item(), "w": fwd.scale[1].item(),
                             "dy": bwd.scale[0].item()}
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        torch_dist.destroy_process_group()


def _tp_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unsharded x [32, 64], w [64, 64] and dy [32, 64] (local weight 32x32, 2 ranks)."""
    g = torch.Generator().manual_seed(1234)
    return (torch.randn(32, 64, generator=g), torch.randn(64, 64, generator=g),
            torch.randn(32, 64, generator=g))


def test_te_distributed_scales_are_those_of_the_unsharded_tensors(tmp_path):
    """Each rank holds a shard of w (and dy or x); after one step under `reduce_amax` every
    rank's x, w and dy scales are `(max_val / amax) / 2**margin` of the whole tensor (l. 880-897,
    940-946), column- and row-parallel: the amaxes are all-reduced before the update."""
    run_ranks(_tp_worker, str(tmp_path))
    x, w, dy = _tp_tensors()

    def ref_scale(t: torch.Tensor, max_val: float) -> float:
        return ((max_val / t.abs().amax()) / (2**2)).item()

    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for mode in ("column", "row"):
            torch.testing.assert_close(results[mode]["x"], ref_scale(x, MAX_FWD))
            torch.testing.assert_close(results[mode]["w"], ref_scale(w, MAX_FWD))
            torch.testing.assert_close(results[mode]["dy"], ref_scale(dy, MAX_BWD))
    # the shards' own amaxes differ, so without the reduction a rank's scales would not match
    assert w[:32].abs().amax() != w[32:].abs().amax()


# -- current scaling: tests/pytorch/test_quantized_tensor.py:484-530 (test_quantize, through
# references/ref_per_tensor_cs.py:13-68 and references/quantize_scale_calc.py:9-60), and
# tests/pytorch/test_multi_tensor.py:340-380 (epsilon 100)

def _ref_scale_from_amax(amax: torch.Tensor, fp8_dtype: torch.dtype, eps: float,
                         pow_2_scales: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """references/quantize_scale_calc.py:26-60 as written (x_dtype float32, l. 16 of
    ref_per_tensor_cs.py); an Inf amax is left out (the reference gives 0 there, TE's kernel 1:
    common/recipe/recipe_common.cuh:24-26, and TE's tests feed none)."""
    fp8_max = torch.finfo(fp8_dtype).max
    amax = torch.max(amax, torch.tensor(eps))
    scale = torch.div(fp8_max, amax)
    scale = torch.where(scale == torch.inf, torch.finfo(torch.float32).max, scale)
    if pow_2_scales:
        _, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.tensor([1.0]), exp - 1)
    scale = torch.where(amax == 0, 1.0, scale)
    return scale, torch.reciprocal(scale)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dims", [[], [1], [311], [7, 11], [7, 5, 3], [2, 3, 5, 3], [128, 128]])
@pytest.mark.parametrize("force_pow_2_scales", [True, False])
@pytest.mark.parametrize("amax_epsilon", [0.0, 1e-6, 100.0])
def test_te_current_scaling_quantize_matches_te_reference(fmt, dtype, dims, force_pow_2_scales,
                                                          amax_epsilon):
    """`2 * rand - 1` in each dtype: the FP8 bytes and scale_inv equal the reference's exactly
    (atol=rtol=0, test_quantized_tensor.py:525-526): scale `fp8_max / max(amax, eps)`, float32
    max for an infinite one, rounded down to a power of 2 if asked, 1 for a zero amax; bytes
    `(x.float() * scale).to(fp8)`; scale_inv `reciprocal(scale)`."""
    fp8_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    g = torch.Generator().manual_seed(1234)
    x = (2 * torch.rand(dims, generator=g) - 1).to(dtype)
    amax = torch.amax(torch.abs(x.to(torch.float32))).view(1)
    scale_ref, scale_inv_ref = _ref_scale_from_amax(amax, fp8_dtype, amax_epsilon,
                                                    force_pow_2_scales)
    q_ref = (x.float() * scale_ref).to(fp8_dtype)

    scale = current_scale(amax, fmt, epsilon=amax_epsilon, power_2=force_pow_2_scales)
    q = quantize(x, scale, fmt)
    torch.testing.assert_close(q.view(torch.uint8), q_ref.view(torch.uint8), atol=0, rtol=0)
    torch.testing.assert_close(scale_inverse(scale), scale_inv_ref, atol=0, rtol=0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow_2_scales", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 100.0])
def test_te_multi_tensor_compute_scale_matches_te_reference(fmt, pow_2_scales, epsilon):
    """test_multi_tensor.py:340-380: amaxes `|randn|` (some below, some above epsilon 100 after
    scaling), scale and scale_inv equal the reference's exactly."""
    fp8_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    g = torch.Generator().manual_seed(1234)
    amaxes = torch.cat([torch.randn(333, generator=g).abs(),
                        torch.randn(333, generator=g).abs() * 300, torch.zeros(2)])
    scale_ref, scale_inv_ref = _ref_scale_from_amax(amaxes, fp8_dtype, epsilon, pow_2_scales)
    scale = current_scale(amaxes, fmt, epsilon=epsilon, power_2=pow_2_scales)
    torch.testing.assert_close(scale, scale_ref, atol=0, rtol=0)
    torch.testing.assert_close(scale_inverse(scale), scale_inv_ref, atol=0, rtol=0)


# -- what TE refuses when it builds a recipe

@pytest.mark.parametrize(("options", "key"), [
    # common/recipe/__init__.py:264 (HEAD), "Pure E5M2 training is not supported."
    ({"fp8_format": "E5M2"}, "fp8_format"),
    ({"scaling": "current", "fp8_format": "E5M2"}, "fp8_format"),
    # DelayedScaling has no `interval` field from v2.2 (v2.1 l. 136-151 warned it was unused)
    ({"interval": 1}, "interval"),
    # a callable amax_compute_algo / scaling_factor_compute_algo: TE's unfused Python update
    ({"amax_compute_algo": max}, "amax_compute_algo"),
    ({"scaling_factor_compute_algo": lambda amax, scale, fp8_max, recipe: scale},
     "scaling_factor_compute_algo"),
])
def test_te_refusals_are_one_line_naming_the_key(options, key):
    """What TE asserts or cannot run the emulation refuses in one line naming the key, rather
    than train with other numbers."""
    with pytest.raises(RecipeError) as error:
        FP8Recipe.from_options(options)
    message = str(error.value)
    assert message.startswith(f"fp8_recipe.{key}: ") and "\n" not in message


# -- tests/pytorch/test_recipe.py:449-505, test_dynamic_recipe_update: TE switches a layer to a
# recipe of another type with a "Recipe type changed" warning (module/base.py:1576-1585, from
# v2.4; set_meta_tensor builds the new type's state, l. 1106-1175)

def test_a_scaling_mode_change_is_refused_without_claiming_te_keeps_the_first():
    """The emulation does not model TE's switch, so it refuses the change in one line; the line
    says what TE would do (switch, with a warning), not that TE keeps the first recipe, which
    is true of a margin or format change within delayed scaling only."""
    layer = EmulatedFP8Linear(16, 16)
    with fp8_autocast(recipe=FP8Recipe(amax_history_len=4)):
        layer(torch.randn(16, 16))
    with pytest.raises(RecipeError) as error:
        with fp8_autocast(recipe=FP8Recipe(scaling="current")):
            layer(torch.randn(16, 16))
    message = str(error.value)
    assert message.startswith("fp8_recipe.scaling: ") and "\n" not in message
    assert "Recipe type changed" in message and "go on with the first" not in message
    # TE 2.2-2.3 switch silently: no warning at v2.3's module/base.py, one from v2.4 (l. 941)
    assert "fresh scaling state (and, from TE 2.4, a 'Recipe type changed' warning)" in message


@pytest.mark.parametrize(("margin", "why"), [
    (2.5, "a fraction: TransformerEngine's recipes declare margin an int, which pydantic 2 refuses "
          "and pydantic 1 truncates to 2"),
    (2.0, "a float: write 2"),
    ("2", "a str, not a number"),
    (True, "a bool, not a number"),
])
def test_a_margin_that_is_no_integer_is_refused_for_what_it_is(margin, why):
    """TE's recipes declare `margin: int` in a pydantic dataclass (common/recipe/__init__.py:
    253 at d0067d0), which reads 2.0 as 2 and refuses 2.5; the emulation takes integers only,
    and its line used to explain every non-integer as a margin too large."""
    with pytest.raises(RecipeError) as error:
        FP8Recipe.from_options({"margin": margin})
    message = str(error.value)
    assert message.startswith(f"fp8_recipe.margin: must be an integer from 0 to 17, got "
                              f"{margin!r} ({why})") and "\n" not in message
    assert "smallest subnormal" not in message
