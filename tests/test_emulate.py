"""EmulatedFP8Linear against an independent replay built from the numerics primitives."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch
from torch import nn

from foundry_fp8 import emulate
from foundry_fp8.emulate import (
    EmulatedFP8Linear,
    active_recipe,
    fp8_autocast,
    fp8_checkpoint,
    is_fp8_enabled,
)
from foundry_fp8.numerics import FP8_MAX, delayed_scale_update, quantize_dequantize
from foundry_fp8.recipe import FP8Recipe


def _replay_scales(amaxes: list[float], fmt: str, history_len: int, algo: str) -> list[float]:
    """Scale in force at each step, by hand: history of the last `history_len` amaxes."""
    scales, history, scale = [], [], 1.0
    for amax in amaxes:
        scales.append(scale)
        history = ([amax] + history)[:history_len]
        ref = max(history) if algo == "max" else history[0]
        scale = FP8_MAX[fmt] / ref if ref > 0 else scale
    return scales


def _te_fp32_linear(qx: torch.Tensor, qw: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float32 layer's FP8 forward as TE 2.20 computes it: the GEMM of the FP8 operands in
    float32, then the bias, which TE casts to bfloat16 for FP8 GEMMs of float32 activations
    (cuBLAS takes no float32 bias with FP8 operands: pytorch/module/linear.py:499-502) and the
    GEMM epilogue adds to the float32 result."""
    out = qx @ qw.t()
    return out if bias is None else out + bias.detach().to(torch.bfloat16).float()


def test_copy_is_exact_and_plain_outside_autocast():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    emulated = EmulatedFP8Linear.from_linear(linear)
    assert torch.equal(emulated.weight, linear.weight) and torch.equal(emulated.bias, linear.bias)
    assert set(dict(emulated.named_parameters())) == {"weight", "bias"}
    assert set(emulated.state_dict()) == {"weight", "bias"}  # FP8 state is fp8_state's job
    x = torch.randn(4, 16)
    assert torch.equal(emulated(x), linear(x))
    # called as nn.Linear can be, by keyword, in and out of the FP8 autocast
    assert torch.equal(emulated(input=x), linear(input=x))
    with fp8_autocast():
        assert torch.equal(emulated(input=x), emulated(x))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_follows_recipe_and_replay(algo):
    torch.manual_seed(0)
    recipe = FP8Recipe(amax_history_len=3, amax_compute_algo=algo)
    layer = EmulatedFP8Linear(16, 8)
    inputs = [torch.randn(4, 16) * s for s in (1.0, 50.0, 2.0, 0.5, 0.1)]
    x_amaxes = [float(x.abs().max()) for x in inputs]
    g_amaxes = []
    want_x_scales = _replay_scales(x_amaxes, "e4m3", 3, algo)
    for step, x in enumerate(inputs):
        x = x.clone().requires_grad_()
        sx, sw = layer.fp8_meta["scaling_fwd"].scale[:2].tolist()  # scales in force
        assert sx == pytest.approx(want_x_scales[step], rel=1e-6)
        with fp8_autocast(recipe=recipe):
            out = layer(x)
        want_out = _te_fp32_linear(quantize_dequantize(x.detach(), sx, "e4m3"),
                                   quantize_dequantize(layer.weight.detach(), sw, "e4m3"),
                                   layer.bias)
        assert torch.equal(out, want_out)
        grad = torch.randn_like(out) * (step + 1)
        g_amaxes.append(float(grad.abs().max()))
        out.backward(grad)
    assert layer.fp8_meta["scaling_fwd"].amax_history.shape == (3, 3)
    # the backward scale after the last step, replayed by hand over the gradient amaxes
    next_g_scale = _replay_scales(g_amaxes + [0.0], "e5m2", 3, algo)[-1]
    assert layer.fp8_meta["scaling_bwd"].scale[0].item() == pytest.approx(next_g_scale, rel=1e-6)


def test_autocast_without_a_recipe_runs_te_default_delayed_scaling():
    """TE's autocast with no recipe uses `DelayedScaling()` on Hopper (pytorch/quantization.py:
    242-254): a 1024-step history (recipe/__init__.py:255), so after a 100x spike the scale
    stays set by it for the next 20 steps, where Composer's 16 would have forgotten it."""
    layer = EmulatedFP8Linear(16, 16)
    x = torch.ones(4, 16)
    for step in range(20):
        with fp8_autocast():
            layer(x * (100.0 if step == 0 else 1.0)).sum().backward()
    meta = layer.fp8_meta["scaling_fwd"]  # slot 0: the input
    assert meta.amax_history.shape[0] == 1024
    assert meta.scale[0].item() == pytest.approx(4.48, rel=1e-6)


def test_current_scaling_keeps_no_history_and_saturates_nothing():
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(16, 8)
    x = torch.randn(4, 16) * 1000
    with fp8_autocast(recipe=FP8Recipe(scaling="current")):
        out = layer(x)
    assert layer.fp8_meta["scaling_fwd"].amax_history.abs().sum() == 0
    sx = FP8_MAX["e4m3"] / x.abs().max()
    sw = FP8_MAX["e4m3"] / layer.weight.detach().abs().max()
    want = _te_fp32_linear(quantize_dequantize(x, sx, "e4m3"),
                           quantize_dequantize(layer.weight.detach(), sw, "e4m3"), layer.bias)
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
def test_state_equals_a_loop_of_delayed_scale_update(fmt):
    """Full history and scales, forward and backward, after every step, with margin and
    most_recent, against numerics.delayed_scale_update fed amaxes taken from the raw tensors."""
    recipe = FP8Recipe(fp8_format=fmt, amax_history_len=3, amax_compute_algo="most_recent",
                       margin=1)
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(16, 8, bias=False)
    fwd_hist, fwd_scale = torch.zeros(3, 3), torch.ones(3)
    bwd_hist, bwd_scale = torch.zeros(3, 2), torch.ones(2)
    bwd_max = FP8_MAX[recipe.format_for("backward")]
    for step in range(5):
        x = torch.randn(4, 16) * 10 ** (step - 2)
        with fp8_autocast(recipe=recipe):
            out = layer(x)
        fwd_hist[0, :2] = torch.stack([x.abs().max(), layer.weight.detach().abs().max()])
        fwd_hist, fwd_scale = delayed_scale_update(fwd_hist, fwd_scale, 448.0, "most_recent", 1)
        grad = torch.randn_like(out) * (step + 1)
        out.backward(grad)
        bwd_hist[0, 0] = grad.abs().max()
        bwd_hist, bwd_scale = delayed_scale_update(bwd_hist, bwd_scale, bwd_max, "most_recent", 1)
        meta = layer.fp8_meta
        assert torch.equal(meta["scaling_fwd"].amax_history, fwd_hist)
        assert torch.equal(meta["scaling_fwd"].scale, fwd_scale)
        assert torch.equal(meta["scaling_bwd"].amax_history, bwd_hist)
        assert torch.equal(meta["scaling_bwd"].scale, bwd_scale)


def test_gradients_equal_float64_reference():
    """dX = qdq(dY) @ qdq(W), dW = qdq(dY)^T @ qdq(X) (E5M2 gradients under HYBRID), and, as in
    TE's fused bgrad, db = sum of the unquantized dY; scales in force, float64."""
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(32, 16)
    recipe = FP8Recipe()
    for step in range(3):  # later steps use non-trivial delayed scales
        x = (torch.randn(2, 5, 32) * (step + 1)).requires_grad_()
        sx, sw = layer.fp8_meta["scaling_fwd"].scale[:2].clone()
        sg = layer.fp8_meta["scaling_bwd"].scale[0].clone()
        layer.zero_grad()
        with fp8_autocast(recipe=recipe):
            out = layer(x)
        grad = torch.randn_like(out) * 1e-3
        out.backward(grad)
        qx = quantize_dequantize(x.detach(), sx, "e4m3").double()
        qw = quantize_dequantize(layer.weight.detach(), sw, "e4m3").double()
        qg = quantize_dequantize(grad, sg, "e5m2").double()
        assert torch.allclose(x.grad.double(), qg @ qw, rtol=1e-5, atol=1e-9)
        want_dw = qg.reshape(-1, 16).t() @ qx.reshape(-1, 32)
        assert torch.allclose(layer.weight.grad.double(), want_dw, rtol=1e-5, atol=1e-9)
        assert torch.allclose(layer.bias.grad.double(), grad.double().sum((0, 1)), rtol=1e-5)
    assert sg != 1.0  # the last step really ran with a delayed backward scale


def test_history_length_change_keeps_rows_and_scales_as_te():
    """TE's adjust_amax_history_length: a changed delayed recipe keeps the first rows (zero rows
    appended when it grows) and the scales."""
    torch.manual_seed(0)
    layer, x = EmulatedFP8Linear(8, 8), torch.randn(4, 8)
    meta = layer.fp8_meta["scaling_fwd"]
    for length in (4, 4):
        with fp8_autocast(recipe=FP8Recipe(amax_history_len=length)):
            layer(x)
    before, scale = meta.amax_history.clone(), meta.scale.clone()
    assert before[1:].abs().sum() > 0
    with fp8_autocast(recipe=FP8Recipe(amax_history_len=6)):
        layer(x)
        grown = meta.amax_history.clone()
        assert torch.equal(meta.scale, scale)
    assert torch.equal(grown[1:4], before[1:4]) and not grown[4:].any()
    after = meta.amax_history.clone()
    with fp8_autocast(recipe=FP8Recipe(amax_history_len=2)):
        layer(x)
        assert torch.equal(meta.amax_history[1:], after[1:2])


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises: a backward pass that dies half-way (an OOM, say)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward died")


def test_backward_scales_update_after_a_backward_that_failed():
    """Composer retries a batch after an OOM in backward; the emulation must go on updating
    backward scales afterwards, as TE does (grad-output amax 1 in the failed pass, 2 after)."""
    recipe = FP8Recipe(amax_history_len=4, amax_compute_algo="max")
    first, last = EmulatedFP8Linear(16, 16, bias=False), EmulatedFP8Linear(16, 16, bias=False)
    x = torch.randn(3, 16, requires_grad=True)
    with fp8_autocast(recipe=recipe):
        out = last(_FailingBackward.apply(first(x)))
    with pytest.raises(RuntimeError, match="backward died"):
        out.sum().backward()  # `last` ran its backward (d out = 1); `first` never did
    assert last.fp8_meta["scaling_bwd"].scale[0].item() == 1.0  # no update yet, as in TE
    with fp8_autocast(recipe=recipe):
        out = last(first(x))
    (2.0 * out.sum()).backward()  # d out = 2 everywhere
    # the history slot holds max(1, 2) = 2 for `last`; `first` saw only this pass
    assert last.fp8_meta["scaling_bwd"].scale[0].item() == FP8_MAX["e5m2"] / 2.0
    assert first.fp8_meta["scaling_bwd"].scale[0].item() > 1.0


# -- nesting, as TE 2.20.2's autocast (pytorch/quantization.py, autocast_enter/autocast_exit) --

def _amaxes(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.detach().abs().max() for t in tensors])


def test_disabled_region_inside_an_enabled_one_runs_in_high_precision():
    """Inside a nested `enabled=False` region the layer is a plain nn.Linear and records no
    amax; after it the outer recipe casts again, and the one forward update at the outermost
    exit is the update of a run without the nested region."""
    torch.manual_seed(0)
    recipe = FP8Recipe(amax_history_len=4)
    linear = nn.Linear(16, 8)
    layer, twin = EmulatedFP8Linear.from_linear(linear), EmulatedFP8Linear.from_linear(linear)
    x0, x1, x2 = torch.randn(4, 16), torch.randn(4, 16) * 3, torch.randn(4, 16) * 1000
    for module in (layer, twin):  # one step first, so the scales in force are not 1
        with fp8_autocast(recipe=recipe):
            module(x0)
    meta = layer.fp8_meta["scaling_fwd"]
    history, scale = meta.amax_history.clone(), meta.scale.clone()
    assert scale[0] == (FP8_MAX["e4m3"] / x0.abs().max().double()).float()
    with fp8_autocast(recipe=recipe):
        with fp8_autocast(enabled=False):
            assert not is_fp8_enabled() and active_recipe() is None
            inside = layer(x2)
            assert torch.equal(inside, linear(x2))
            assert torch.equal(meta.amax_history, history)
        assert is_fp8_enabled() and active_recipe() is recipe
        out = layer(x1)
        assert torch.equal(meta.scale, scale)  # the nested exit updated nothing
    assert not is_fp8_enabled()
    want = _te_fp32_linear(quantize_dequantize(x1, scale[0], "e4m3"),
                           quantize_dequantize(linear.weight.detach(), scale[1], "e4m3"),
                           linear.bias)
    assert torch.equal(out, want)
    history[0, :2] = _amaxes(x1, linear.weight)
    want_history, want_scale = delayed_scale_update(history, scale, FP8_MAX["e4m3"])
    assert torch.equal(meta.amax_history, want_history) and torch.equal(meta.scale, want_scale)
    with fp8_autocast(recipe=recipe):
        twin(x1)
    assert torch.equal(twin.fp8_meta["scaling_fwd"].amax_history, want_history)
    assert torch.equal(twin.fp8_meta["scaling_fwd"].scale, want_scale)
    backward = layer.fp8_meta["scaling_bwd"].amax_history.clone()
    inside.sum().backward()  # the high-precision forward's backward records nothing either
    assert torch.equal(layer.fp8_meta["scaling_bwd"].amax_history, backward)


@pytest.mark.parametrize("around", [lambda: fp8_autocast(enabled=False), torch.no_grad],
                         ids=["disabled-outermost", "no_grad"])
def test_amaxes_cast_without_an_update_wait_for_the_next_one(
        around: Callable[[], AbstractContextManager]):
    """TE updates forward scales only when an enabled autocast leaves the last open region with
    grad enabled; until then the amax stays in history slot 0, maxed with the next ones."""
    torch.manual_seed(0)
    recipe = FP8Recipe(amax_history_len=4)
    layer = EmulatedFP8Linear(16, 8)
    x1, x2 = torch.randn(4, 16) * 5, torch.randn(4, 16) * 0.5
    with around():
        with fp8_autocast(recipe=recipe):
            layer(x1)
    meta = layer.fp8_meta["scaling_fwd"]
    assert torch.equal(meta.scale, torch.ones(3))
    assert meta.amax_history[0, 0] == x1.abs().max()
    with fp8_autocast(recipe=recipe):
        layer(x2)
    history = torch.zeros(4, 3)
    history[0, :2] = torch.stack([max(x1.abs().max(), x2.abs().max()),
                                  layer.weight.detach().abs().max()])
    want_history, want_scale = delayed_scale_update(history, torch.ones(3), FP8_MAX["e4m3"])
    assert torch.equal(meta.amax_history, want_history) and torch.equal(meta.scale, want_scale)


def test_nested_recipe_casts_inside_and_updates_its_layers_at_the_outermost_exit():
    """A nested recipe replaces the enclosing one (None: the default recipe, as TE's default);
    its layers are updated with it, forward and backward, and only at the outermost exit."""
    torch.manual_seed(0)
    outer = FP8Recipe(amax_history_len=4)  # HYBRID, max, margin 0
    inner = FP8Recipe(fp8_format="E4M3", amax_history_len=2, amax_compute_algo="most_recent",
                      margin=1)
    a, b = EmulatedFP8Linear(16, 16, bias=False), EmulatedFP8Linear(16, 8, bias=False)
    x = torch.randn(4, 16) * 3
    with fp8_autocast(recipe=outer):
        h = a(x)
        h.retain_grad()
        with fp8_autocast(recipe=inner):
            assert active_recipe() is inner
            out = b(h)
            with fp8_autocast():
                assert active_recipe() == FP8Recipe(amax_history_len=1024)  # DelayedScaling()
        assert active_recipe() is outer
        assert torch.equal(b.fp8_meta["scaling_fwd"].scale, torch.ones(3))
    grad = torch.randn_like(out) * 7
    out.backward(grad)
    cases = [(a, "scaling_fwd", 4, 3, _amaxes(x, a.weight), 448.0, "max", 0),
             (b, "scaling_fwd", 2, 3, _amaxes(h, b.weight), 448.0, "most_recent", 1),
             (a, "scaling_bwd", 4, 2, _amaxes(h.grad), 57344.0, "max", 0),
             (b, "scaling_bwd", 2, 2, _amaxes(grad), 448.0, "most_recent", 1)]
    for layer, which, length, n, amaxes, fp8_max, algo, margin in cases:
        history = torch.zeros(length, n)
        history[0, :len(amaxes)] = amaxes
        want_history, want_scale = delayed_scale_update(history, torch.ones(n), fp8_max, algo,
                                                        margin)
        meta = layer.fp8_meta[which]
        assert torch.equal(meta.amax_history, want_history), (which, length)
        assert torch.equal(meta.scale, want_scale), (which, length)


# -- zero amaxes, as TE's default fused update (transformer_engine/common/recipe/delayed_scaling.cu)

class _KernelSlot:
    """One scale slot under TE's fused update, restated in float64: a window over the non-zero
    amaxes recorded so far; an update that recorded nothing (amax 0) changes nothing."""

    def __init__(self, fp8_max: float, recipe: FP8Recipe):
        self.scaled_max = fp8_max * 2.0 ** -recipe.margin
        self.length, self.algo = recipe.amax_history_len, recipe.amax_compute_algo
        self.recorded: list[float] = []
        self.scale = 1.0

    def update(self, amax: float) -> None:
        if amax == 0:
            return
        window = (self.recorded + [amax])[-self.length:]
        ref = amax if self.algo == "most_recent" else max(window)
        self.scale = torch.tensor(self.scaled_max / ref, dtype=torch.float32).item()
        self.recorded.append(amax)

    def history(self) -> list[float]:
        """As TE lays it out: row 0 empty, then the last length-1 amaxes, oldest first."""
        padded = [0.0] * (self.length - 1) + self.recorded
        return [0.0] + padded[len(padded) - (self.length - 1):]


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_zero_amax_slots_are_left_alone_as_te_does(algo):
    """A zero-initialised weight (amax 0 until the first optimizer step), all-zero batches and
    the never-cast output and grad-input slots: after every step, both directions equal
    `_KernelSlot`s fed the amaxes of the raw tensors."""
    recipe = FP8Recipe(amax_history_len=3, amax_compute_algo=algo, margin=1)
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(16, 8)
    nn.init.zeros_(layer.weight)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    slots = {"scaling_fwd": [_KernelSlot(FP8_MAX["e4m3"], recipe) for _ in range(3)],
             "scaling_bwd": [_KernelSlot(FP8_MAX["e5m2"], recipe) for _ in range(2)]}
    x_amaxes = []
    for step, size in enumerate([4.0, 0.0, 1.0, 0.0, 0.0, 0.5]):
        x = torch.randn(4, 16) * size
        weight_amax = layer.weight.detach().abs().max().item()
        assert (weight_amax == 0) == (step == 0)
        with fp8_autocast(recipe=recipe):
            out = layer(x)
        grad = torch.randn_like(out)
        out.backward(grad)
        optimizer.step()
        optimizer.zero_grad()
        x_amaxes.append(x.abs().max().item())
        amaxes = {"scaling_fwd": [x_amaxes[-1], weight_amax, 0.0],
                  "scaling_bwd": [grad.abs().max().item(), 0.0]}
        for which, meta_slots in slots.items():
            for slot, amax in zip(meta_slots, amaxes[which], strict=True):
                slot.update(amax)
            meta = layer.fp8_meta[which]
            want_history = torch.tensor([slot.history() for slot in meta_slots]).t()
            assert torch.equal(meta.amax_history, want_history), (step, which)
            assert torch.equal(meta.scale, torch.tensor([s.scale for s in meta_slots])), (step, which)
    if algo == "max":  # three zero batches did not push the first amax out (rolling would)
        assert x_amaxes[0] == max(x_amaxes)
        scale = layer.fp8_meta["scaling_fwd"].scale[0].item()
        assert scale == pytest.approx(224.0 / x_amaxes[0], rel=1e-6)


# -- fp8_checkpoint around a function that opens its own fp8_autocast (TE 2.20.2 distributed.py)

class _OwnAutocastBlock(nn.Module):
    """A block that turns FP8 on itself (a model choosing its precision per block)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = EmulatedFP8Linear(16, 32), EmulatedFP8Linear(32, 16)

    def forward(self, x):
        with fp8_autocast(recipe=FP8Recipe(amax_history_len=3)):
            return x + self.down(nn.functional.gelu(self.up(x)))


def _train_own_autocast(checkpoint, outer: Callable[[], AbstractContextManager], steps: int = 3):
    """Per step: input and weight gradients, then every layer's histories and scales."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(_OwnAutocastBlock() for _ in range(2))
    optimizer = torch.optim.SGD(blocks.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    results = []
    for step in range(steps):
        x = (torch.randn(8, 16, generator=generator) * (step + 1)).requires_grad_()
        with outer():
            h = x
            for block in blocks:
                h = block(h) if checkpoint is None else checkpoint(block, h)
        (h * torch.randn(h.shape, generator=generator)).sum().backward()
        tensors = [x.grad] + [p.grad for p in blocks.parameters()]
        tensors += [t for m in blocks.modules() if isinstance(m, EmulatedFP8Linear)
                    for meta in m.fp8_meta.values() for t in (meta.amax_history, meta.scale)]
        results.append([t.clone() for t in tensors])
        optimizer.step()
        optimizer.zero_grad()
    return results


def _plain_checkpoint(function, x):
    return torch.utils.checkpoint.checkpoint(function, x, use_reentrant=False)


@pytest.mark.parametrize("outer", [nullcontext, lambda: fp8_autocast(recipe=FP8Recipe(fp8_format="E4M3"))],
                         ids=["outside-fp8", "inside-another-recipe"])
def test_checkpointed_function_with_its_own_autocast_is_bit_identical(outer):
    """As TE 2.20.2 stashes inside the function's own autocast, the recompute casts with the
    original scales; the inner region's exit in it is nested, and the recompute's own region
    finds nothing recorded since the forward's update: gradients, histories and scales equal a
    run without checkpointing. Plain torch checkpoint (what fp8_checkpoint did
    outside FP8) recomputes with the updated scales and updates once more, so it differs."""
    reference = _train_own_autocast(None, outer)
    for got, want in zip(_train_own_autocast(fp8_checkpoint, outer), reference, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    plain = _train_own_autocast(_plain_checkpoint, outer, steps=1)[0]
    n_grads = 1 + 4 * 2  # x, then weight and bias of each of the 4 layers
    assert not torch.equal(plain[0], reference[0][0])  # input gradient
    assert not all(torch.equal(a, b) for a, b in zip(plain[1:n_grads], reference[0][1:n_grads],
                                                     strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(plain[n_grads:], reference[0][n_grads:],
                                                     strict=True))


def test_torch_compile_runs_the_emulated_layers_eagerly_without_recompiling():
    """Under torch.compile the emulated layers are left to eager (their histories are sized at
    the first cast and the autocast state is module-level: Dynamo recompiled for each change and
    hit its recompile limit, a 214 s first batch on the tiny MPT); after the first step nothing
    recompiles, and outputs, gradients and FP8 state (forward and backward) equal an eager
    copy's."""
    import copy

    import torch._dynamo

    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(32, 64), nn.GELU(), EmulatedFP8Linear(64, 32))
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager")
    recipe = FP8Recipe(amax_history_len=4)
    torch._dynamo.reset()
    for step in range(3):
        x = torch.randn(8, 32) * (step + 1)
        with torch._dynamo.config.patch(error_on_recompile=step > 0), fp8_autocast(recipe=recipe):
            out = compiled(x)
        with fp8_autocast(recipe=recipe):
            want = eager(x)
        assert torch.equal(out, want)
        out.square().sum().backward()  # the backward scales too (the first module's update)
        want.square().sum().backward()
    for mine, theirs in zip(model, eager, strict=True):
        if isinstance(mine, EmulatedFP8Linear):
            assert torch.equal(mine.weight.grad, theirs.weight.grad)
            for key in ("scaling_fwd", "scaling_bwd"):
                assert torch.equal(mine.fp8_meta[key].amax_history,
                                   theirs.fp8_meta[key].amax_history)
                assert torch.equal(mine.fp8_meta[key].scale, theirs.fp8_meta[key].scale)
            assert mine.fp8_meta["scaling_bwd"].scale[0] != 1  # updated state is compared


def _te_refuses(shape: tuple[int, ...]) -> bool:
    """TE 2.20's `assert_dim_for_fp8_exec` (transformer_engine/pytorch/utils.py:614-623), which
    te.Linear's FP8 forward calls on its input and weight (module/linear.py:376)."""
    leading = 1
    for n in shape[:-1]:
        leading *= n
    return leading % 8 != 0 or shape[-1] % 16 != 0


def _forward_line(refused: list[tuple[str, tuple[int, ...]]]) -> str:
    named = " and ".join(f"{name} of shape {list(shape)}" for name, shape in refused)
    return (f"EmulatedFP8Linear: FP8 {named}: TransformerEngine stops the forward with ValueError "
            "under any recipe (assert_dim_for_fp8_exec: the product of the leading dims must be "
            "divisible by 8 and the last dim by 16); the emulation runs it (only the first such "
            "shape is warned of)")


def _backward_line(x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> str | None:
    """TE's Hopper FP8 backward GEMMs (TN only, cublaslt_gemm.cu:160-163): the inner dim of the
    weight-gradient GEMM is the tokens, the input-gradient GEMM's is out_features; each by 16."""
    tokens = math.prod(x_shape[:-1])
    needs = [f"{what} ({n}) for the {gemm} GEMM" for what, n, gemm in (
        ("the tokens", tokens, "weight-gradient"), ("out_features", w_shape[0], "input-gradient"))
        if n % 16]
    if not needs:
        return None
    return (f"EmulatedFP8Linear: FP8 input of shape {list(x_shape)} and weight of shape "
            f"{list(w_shape)}: TransformerEngine's forward accepts them, but its FP8 backward on "
            f"Hopper needs {' and '.join(needs)} divisible by 16 and stops with 'Leading "
            "dimension requirement on A for FP8 GEMM. Caller must pad.' (read in TE's "
            "cublaslt_gemm.cu, not run on a GPU); the emulation runs it (only the first such "
            "shape is warned of)")


def _shape_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "TransformerEngine stops" in str(w.message)
            or "Caller must pad" in str(w.message)]


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The emulation's warnings are given once per kind per run; each test starts with
    none given."""
    monkeypatch.setattr(emulate, "_WARNED", {})


@pytest.mark.parametrize(("x_shape", "w_shape"), [
    ((3, 5, 64), (32, 64)), ((2, 4, 64), (32, 64)), ((8, 24), (16, 24)), ((16, 64), (12, 64)),
    ((64,), (32, 64)), ((16, 64), (24, 64)), ((4, 4, 64), (48, 64)), ((3, 64), (12, 64)),
])
def test_a_gemm_te_would_refuse_warns_once(fresh_warnings, x_shape, w_shape):
    """te.Linear stops an FP8 forward with ValueError for these shapes; the emulation ran them
    silently, so a run ready on the CPU (an odd sequence length, a short last batch) crashed
    on the GPU. Shapes the forward accepts but whose tokens or out_features are no multiple of
    16 stop TE's FP8 backward GEMMs on Hopper; eval forwards (no grad) warn of the forward
    only. Input and weight refused at once: one line naming both."""
    refused = [(name, shape) for name, shape in (("input", x_shape), ("weight", w_shape))
               if _te_refuses(shape)]
    forward = [_forward_line(refused)] if refused else []
    backward = [] if refused else [line for line in [_backward_line(x_shape, w_shape)] if line]
    layer = EmulatedFP8Linear(w_shape[1], w_shape[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        with torch.no_grad(), fp8_autocast(recipe=FP8Recipe()):
            layer(torch.randn(x_shape))
        assert _shape_warnings(caught) == forward
        for _ in range(3):
            with fp8_autocast(recipe=FP8Recipe()):
                layer(torch.randn(x_shape)).sum().backward()
            with warnings.catch_warnings():  # resets Python's once-per-message record
                pass
    assert _shape_warnings(caught) == forward + backward  # not again at a later step


def test_variable_lengths_warn_once_per_kind_naming_the_first_shape(fresh_warnings):
    """With dynamic padding every batch can have a new length: the warning was given once per
    shape, so a long run's log got one line per new length (7 lines for these 8 batches). Now
    one forward line and one backward line, each naming the first shape of its kind, however
    the warnings filter is reset between steps."""
    layer = EmulatedFP8Linear(64, 32)
    lengths = [(2, 7), (2, 9), (1, 24), (3, 5), (1, 40), (1, 16), (2, 13), (2, 12)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for batch, length in lengths:
            with fp8_autocast(recipe=FP8Recipe()):
                layer(torch.randn(batch, length, 64)).sum().backward()
            with warnings.catch_warnings():
                pass
    first_forward = next(s for s in lengths if _te_refuses((*s, 64)))
    first_backward = next(s for s in lengths if not _te_refuses((*s, 64))
                          and math.prod(s) % 16)
    assert _shape_warnings(caught) == [_forward_line([("input", (*first_forward, 64))]),
                                       _backward_line((*first_backward, 64), (32, 64))]


def test_shape_warnings_come_once_under_fp8_checkpoint_and_not_under_backward_override(
        fresh_warnings, monkeypatch):
    """The recompute of `fp8_checkpoint` runs the forward again: no second warning. With
    NVTE_BACKWARD_OVERRIDE set, TE's backward GEMMs run in high precision: no backward one."""
    layer = EmulatedFP8Linear(64, 24)
    x_shape = (3, 8, 64)  # 24 tokens: forward fine, backward's 16 not; out_features 24 too
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(x_shape, requires_grad=True)
            with fp8_autocast(recipe=FP8Recipe()):
                fp8_checkpoint(layer, x).sum().backward()
    assert _shape_warnings(caught) == [_backward_line(x_shape, (24, 64))]
    assert "the tokens (24) for the weight-gradient GEMM and out_features (24) for the " \
        "input-gradient GEMM" in _shape_warnings(caught)[0]
    monkeypatch.setattr(emulate, "_WARNED", {})
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "high_precision")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fp8_autocast(recipe=FP8Recipe(scaling="current")):
            EmulatedFP8Linear(64, 24)(torch.randn(x_shape)).sum().backward()
    assert _shape_warnings(caught) == []


def _unfused_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "NVTE_UNFUSED_FP8_UPDATE" in str(w.message)]


@pytest.mark.parametrize("value", ["1", None, "0"])
def test_te_s_unfused_update_switch_is_named_not_ignored(fresh_warnings, monkeypatch, value):
    """NVTE_UNFUSED_FP8_UPDATE=1 makes TE update delayed scales with its Python path
    (transformer_engine/pytorch/quantization.py:687-711, 1067-1166), which rolls a history that
    recorded nothing, unlike the fused kernel the emulation models: the emulation used to
    ignore the variable in silence. Unset or 0: TE's fused kernel, no warning."""
    if value is None:
        monkeypatch.delenv("NVTE_UNFUSED_FP8_UPDATE", raising=False)
    else:
        monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", value)
    layer = EmulatedFP8Linear(16, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fp8_autocast(recipe=FP8Recipe()):
            out = layer(torch.randn(16, 16))
        out.sum().backward()
    if value == "1":  # one, though the forward and the backward update both ran
        assert _unfused_warnings(caught) == [
            "NVTE_UNFUSED_FP8_UPDATE=1: TransformerEngine would update delayed scales with its "
            "unfused Python path (which also rolls histories that recorded nothing); the "
            "emulation models the fused kernel only, so its histories and scales can differ "
            "from TE's (unset NVTE_UNFUSED_FP8_UPDATE to compare them)"]
    else:
        assert _unfused_warnings(caught) == []


def test_the_unfused_update_warning_comes_once_whatever_resets_the_filter(fresh_warnings,
                                                                          monkeypatch):
    """The warning ran at every update of every buffer and relied on Python's once-per-message
    record, which any `warnings.catch_warnings()` resets (trainers and pytest open one around
    steps): two layers, 4 steps, a reset after each gave 4 warnings. Now 1 per run."""
    monkeypatch.setenv("NVTE_UNFUSED_FP8_UPDATE", "1")
    layers = nn.Sequential(EmulatedFP8Linear(16, 16), EmulatedFP8Linear(16, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(4):
            with fp8_autocast(recipe=FP8Recipe()):
                out = layers(torch.randn(16, 16))
            out.sum().backward()
            with warnings.catch_warnings():
                pass
    assert len(_unfused_warnings(caught)) == 1
