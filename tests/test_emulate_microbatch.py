"""`is_first_microbatch`: TE's FP8 weight cache, against references written from TE 2.20's
sources (2.20.0.dev0, commit d0067d0). te.Linear keeps the FP8 weight in
`_fp8_workspaces["weight"]` whenever the argument is given (pytorch/module/linear.py:1958-1961,
2068-2071); `quantize_weight` (module/base.py:792-890) casts afresh when it is None or True
(`update_ws`, linear.py:479) and returns the kept cast untouched when it is False, so that forward
records no weight amax and the fused update leaves the weight's history column and scale alone
(common/recipe/delayed_scaling.cu:182-186). On Hopper a kept cast without the transpose is not
reused where a backward needs one (`_is_weight_workspace_valid`, base.py:757-768). Before this,
passing the argument raised TypeError."""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast, fp8_checkpoint
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.te.facts import BACKWARD_OVERRIDE_ENV
from tests.test_emulate_gpu import (
    FP8_FAST_ACCUMULATION,
    FP32_GEMM,
    ROUNDING,
    _close,
    _te_autocast,
    _te_recipe,
    _within,
)
from tests.test_emulate_te import E4M3, fp8, te_amax, te_scale

DELAYED = FP8Recipe(amax_history_len=4)
CURRENT = FP8Recipe(scaling="current")


def _layer() -> EmulatedFP8Linear:
    torch.manual_seed(0)
    return EmulatedFP8Linear(16, 16, bias=False)


def _input(amax: float, grad: bool = True) -> torch.Tensor:
    x = torch.full((16, 16), 0.5)
    x[3, 5] = amax
    return x.requires_grad_(grad)


def _product(x: torch.Tensor, sx: float, w: torch.Tensor, sw: float) -> torch.Tensor:
    """The forward GEMM of FP8 operands cast with scales sx and sw, in float64 (the emulation
    multiplies in float32: compared to 1e-6)."""
    return (fp8(x, sx, E4M3) / sx) @ (fp8(w, sw, E4M3) / sw).T


def _step(layer: EmulatedFP8Linear, x: torch.Tensor, first: bool | None,
          recipe: FP8Recipe = DELAYED) -> torch.Tensor:
    with fp8_autocast(recipe=recipe):
        out = layer(x, is_first_microbatch=first)
    if x.requires_grad:
        out.sum().backward()
    return out


def test_false_reuses_the_weight_cast_of_the_first_microbatch_and_records_no_weight_amax():
    """Microbatch 1 (True) casts the weight at the initial scale 1 and keeps the cast; its exit
    rolls the amaxes in and sets the weight scale to 448 / amax(w). Microbatch 2 (False) casts
    only the input (at 448 / 3): the output is the product with the kept weight cast at scale 1
    (a fresh cast would use 448 / amax(w)); the weight column records nothing, so the update
    leaves it and its scale as they were, while the input column rolls again."""
    layer = _layer()
    w = layer.weight.detach().clone()
    _step(layer, _input(3.0), True)
    out = _step(layer, _input(5.0), False)
    sx = te_scale(E4M3, 3.0)
    torch.testing.assert_close(out.double(), _product(_input(5.0), sx, w, 1.0),
                               rtol=1e-6, atol=1e-6)
    meta = layer.fp8_meta["scaling_fwd"]
    assert meta.amax_history[:, :2].tolist() == [[0, 0], [0, 0], [3.0, 0], [5.0, te_amax(w)]]
    assert meta.scale[:2].tolist() == [te_scale(E4M3, 5.0), te_scale(E4M3, te_amax(w))]


def test_true_and_none_cast_afresh_and_only_true_replaces_the_kept_cast():
    """A step with True, then one with None (casts the weight at 448 / amax(w) and records it,
    the kept cast untouched), then False after the weight changed: TE reuses the cast kept at
    the True step (scale 1, the old weight), not the None step's."""
    layer = _layer()
    w = layer.weight.detach().clone()
    _step(layer, _input(3.0), True)
    _step(layer, _input(3.0), None)
    assert layer.fp8_meta["scaling_fwd"].amax_history[:, 1].tolist() == [0, 0, te_amax(w),
                                                                          te_amax(w)]
    with torch.no_grad():
        layer.weight.mul_(2.0)
    out = _step(layer, _input(3.0), False)
    torch.testing.assert_close(out.double(), _product(_input(3.0), te_scale(E4M3, 3.0), w, 1.0),
                               rtol=1e-6, atol=1e-6)


def test_a_cast_kept_without_transpose_is_not_reused_for_a_training_forward():
    """True under no_grad keeps a cast without the transpose (and, without grad, updates no
    scale: both stay 1). False with an input that needs a gradient cannot use that cast on
    Hopper, so the weight, doubled since, is cast afresh at scale 1 and its amax recorded: the
    update rolls 2 * amax(w) into the weight column, where reusing the cast would leave it 0."""
    layer = _layer()
    w = layer.weight.detach().clone()
    with torch.no_grad():
        _step(layer, _input(3.0, grad=False), True)
        layer.weight.mul_(2.0)
    out = _step(layer, _input(3.0), False)
    torch.testing.assert_close(out.double(), _product(_input(3.0), 1.0, 2 * w, 1.0),
                               rtol=1e-6, atol=1e-6)
    assert layer.fp8_meta["scaling_fwd"].amax_history[:, 1].tolist() == [0, 0, 0,
                                                                          2 * te_amax(w)]


def test_current_scaling_reuses_the_kept_cast_with_its_own_scale():
    """Current scaling: False reuses the weight cast at the True step with that weight's own
    scale (448 / amax of the old weight), whatever the weight is now."""
    layer = _layer()
    w = layer.weight.detach().clone()
    _step(layer, _input(3.0), True, CURRENT)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    out = _step(layer, _input(5.0), False, CURRENT)
    expected = _product(_input(5.0), te_scale(E4M3, 5.0), w, te_scale(E4M3, te_amax(w)))
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)


def test_outside_fp8_the_argument_changes_nothing():
    layer = _layer()
    x = _input(3.0)
    torch.testing.assert_close(layer(x, is_first_microbatch=True), layer(x))
    assert layer._fp8_weight_cache is None


def test_a_checkpointed_microbatch_reuses_the_cast_in_the_recompute():
    """fp8_checkpoint with False: the recompute casts the input with the stashed scale and reuses
    the kept weight cast, so the gradients equal those of the same step without checkpointing."""
    grads = []
    for checkpoint in (False, True):
        layer = _layer()
        _step(layer, _input(3.0), True)
        layer.weight.grad = None
        x = _input(5.0)
        with fp8_autocast(recipe=DELAYED):
            out = (fp8_checkpoint(layer, x, is_first_microbatch=False) if checkpoint
                   else layer(x, is_first_microbatch=False))
        out.sum().backward()
        grads.append((x.grad, layer.weight.grad))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_a_cast_made_by_false_with_none_kept_is_kept():
    """False with no cast kept misses, casts at scale 1 and keeps the cast (TE stores a new
    workspace whenever the argument is given, linear.py:2068-2071); the next False, the weight
    doubled since, reuses it: the old weight at scale 1."""
    layer = _layer()
    w = layer.weight.detach().clone()
    _step(layer, _input(3.0), False)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    out = _step(layer, _input(3.0), False)
    torch.testing.assert_close(out.double(), _product(_input(3.0), te_scale(E4M3, 3.0), w, 1.0),
                               rtol=1e-6, atol=1e-6)


def test_a_checkpointed_forward_needs_the_transpose_even_without_an_input_gradient():
    """In a checkpoint's first forward TE casts the weight with its transpose
    (linear.py:470-474), so a cast kept without it (True with an input needing no gradient) is
    not reused: False casts afresh and records amax(w), which the update rolls in next to the
    True step's."""
    layer = _layer()
    w = layer.weight.detach().clone()
    _step(layer, _input(3.0, grad=False), True)
    with fp8_autocast(recipe=DELAYED):
        fp8_checkpoint(layer, _input(3.0, grad=False), is_first_microbatch=False).sum().backward()
    assert layer.fp8_meta["scaling_fwd"].amax_history[:, 1].tolist() == [0, 0, te_amax(w),
                                                                          te_amax(w)]


def test_a_recompute_recasts_with_the_restored_weight_scale_where_the_kept_cast_lacks_the_transpose():
    """History length 1. The checkpointed False forward reuses the True step's cast (weight scale
    then 448 / amax(w), stashed with the input's). The weight is scaled by 0.3 and a None step
    sets its scale to 448 / amax(0.3 w); True with an input needing no gradient then keeps a
    cast without the transpose. The recompute needs it (linear.py:467), so TE casts 0.3 w again
    with the restored scale 448 / amax(w) (quantization.py:832-833), not the kept one's: the
    input gradient (grad_out ones, exact in E5M2) is ones @ that cast."""
    recipe = FP8Recipe(amax_history_len=1)
    layer = _layer()
    w = layer.weight.detach().clone()
    _step(layer, _input(3.0), True, recipe)
    x = _input(5.0)
    with fp8_autocast(recipe=recipe):
        out = fp8_checkpoint(layer, x, is_first_microbatch=False)
    with torch.no_grad():
        layer.weight.mul_(0.3)
    _step(layer, _input(3.0), None, recipe)
    _step(layer, _input(3.0, grad=False), True, recipe)
    out.sum().backward()
    sw = te_scale(E4M3, te_amax(w))
    expected = torch.ones(16, 16, dtype=torch.float64) @ (fp8(layer.weight, sw, E4M3) / sw)
    torch.testing.assert_close(x.grad.double(), expected, rtol=1e-6, atol=1e-6)


def test_a_cast_kept_under_a_backward_override_has_no_transpose(monkeypatch):
    """Under NVTE_BACKWARD_OVERRIDE TE casts the weight without its transpose whatever the input
    (linear.py:468-469), so a later False without the override, whose input needs a gradient,
    does not reuse that cast: current scaling casts the weight, scaled by 0.3 since, with its
    own scale 448 / amax(0.3 w)."""
    layer = _layer()
    monkeypatch.setenv(BACKWARD_OVERRIDE_ENV, "high_precision")
    _step(layer, _input(3.0), True, CURRENT)
    monkeypatch.delenv(BACKWARD_OVERRIDE_ENV)
    with torch.no_grad():
        layer.weight.mul_(0.3)
    w = layer.weight.detach().clone()
    out = _step(layer, _input(5.0), False, CURRENT)
    expected = _product(_input(5.0), te_scale(E4M3, 5.0), w, te_scale(E4M3, te_amax(w)))
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)



def test_under_fsdp2_false_casts_the_weight_afresh(one_rank_group):
    """TE keeps no FP8 weight under FSDP2 (`cache_name=None if ... self.is_fsdp2`,
    linear.py:1958): after True, False casts the weight, halved since, at its updated scale
    448 / amax(w). Inside the forward FSDP2's weight is a plain tensor, not its DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layer = _layer()
    w = layer.weight.detach().clone()
    fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
    _step(layer, _input(3.0), True)
    with torch.no_grad():
        layer.weight.mul_(0.5)
    out = _step(layer, _input(3.0), False)
    expected = _product(_input(3.0), te_scale(E4M3, 3.0), 0.5 * w, te_scale(E4M3, te_amax(w)))
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    assert layer._fp8_weight_cache is None


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_microbatches_match_te_linear(scaling):
    """Against te.Linear on a GPU (written here, never run: no GPU in this session): 2 steps of 3
    microbatches, each in its own autocast, `is_first_microbatch` True then False, an SGD step
    between the steps. Delayed: every history and scale bit-exact after every microbatch;
    outputs and input gradients within `test_emulate_gpu`'s bounds."""
    te = pytest.importorskip("transformer_engine.pytorch")
    recipe = DELAYED if scaling == "delayed" else CURRENT
    torch.manual_seed(0)
    reference = te.Linear(768, 768, device="cuda")
    emulated = EmulatedFP8Linear(768, 768, device="cuda")
    with torch.no_grad():
        emulated.weight.copy_(reference.weight)
        emulated.bias.copy_(reference.bias)
    generator = torch.Generator(device="cuda").manual_seed(1)
    for step in range(2):
        for micro in range(3):
            x = torch.randn(64, 768, device="cuda", generator=generator) * (micro + 1)
            grad = torch.randn(64, 768, device="cuda", generator=generator)
            inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
            with _te_autocast(te, _te_recipe(recipe)):
                out_te = reference(inputs[0], is_first_microbatch=micro == 0)
            with fp8_autocast(recipe=recipe):
                out_emulated = emulated(inputs[1], is_first_microbatch=micro == 0)
            out_te.backward(grad)
            out_emulated.backward(grad)
            where = f"step {step} microbatch {micro}"
            _within(out_te, out_emulated.detach().double(),  # TE's fast accumulation
                    ROUNDING[torch.float32] + FP32_GEMM + FP8_FAST_ACCUMULATION, f"{where} output")
            _close(inputs[1].grad, inputs[0].grad, f"{where} dgrad")
            if scaling == "delayed":
                got, want = read_fp8_meta(emulated), read_fp8_meta(reference)
                for key in ("fwd_amax_history", "fwd_scale", "bwd_amax_history", "bwd_scale"):
                    assert torch.equal(got[key], want[key]), (where, key, got[key], want[key])
        with torch.no_grad():
            for p_te, p_emulated in ((reference.weight, emulated.weight),
                                     (reference.bias, emulated.bias)):
                p_te -= 0.01 * p_te.grad
                p_emulated.copy_(p_te)
        for p in (*reference.parameters(), *emulated.parameters()):
            p.grad = None
