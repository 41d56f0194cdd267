"""NVTE_BACKWARD_OVERRIDE in the emulated backend, against TE's backward as its sources write it
(TE v2.15, the first release reading the variable; the same in release_v2.19 and main d0067d0):
with an override a te.Linear's backward sets `ctx.fp8 = False` (pytorch/module/linear.py:
554-564), so the gradient is not cast; dgrad multiplies it by `saved_weight` (`high_precision`)
or by the forward's FP8 weight dequantized to the activation dtype (`dequantized`, l. 804-812);
wgrad uses the original input cast to the activation dtype (`high_precision` saves it, l. 141-142)
or the FP8 input dequantized (l. 722-727); each GEMM rounds once to the activation dtype. The
forward is unchanged. A value other than `high_precision`/`dequantized`, or any value with
DelayedScaling, fails TE's recipe `__post_init__` asserts (common/recipe/__init__.py:224-228).

The FP8 casts of the reference are written here from TE's formulas, with torch's FP8 dtypes:
scale = fp8_max / amax in float32 (recipe_common.cuh:31), q = saturate(x * scale) cast to FP8,
dequantized as q * (1 / scale) (dequantize_fp8.cuh:31-32).
"""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe, RecipeError

FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


def _round_trip(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """TE's current-scaling cast and dequantize of t, float32."""
    dtype, fp8_max = FP8[fmt]
    scale = torch.tensor(fp8_max, dtype=torch.float32) / t.float().abs().max()
    q = (t.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)
    return q.float() * (torch.tensor(1.0, dtype=torch.float32) / scale)


def _run(monkeypatch, override: str | None, recipe: FP8Recipe, dtype=torch.bfloat16):
    if override is None:
        monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)
    else:
        monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", override)
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(64, 32, bias=True, dtype=dtype)
    x = torch.randn(4, 8, 64, dtype=dtype, requires_grad=True)
    grad = torch.randn(4, 8, 32, dtype=dtype)
    with fp8_autocast(recipe=recipe):
        y = layer(x)
    y.backward(grad)
    return layer, x, grad, y


CURRENT = FP8Recipe(scaling="current")


def _reference(layer, x, grad, mode):
    """(grad_x, grad_w) by TE's formulas for `mode` (None: the FP8 backward)."""
    w = layer.weight.detach()
    xs = x.detach()
    if mode is None:
        g, wm, xm = _round_trip(grad, "e5m2"), _round_trip(w, "e4m3"), _round_trip(xs, "e4m3")
    elif mode == "high_precision":
        g, wm, xm = grad.float(), w.float(), xs.float()
    else:
        g = grad.float()
        wm = _round_trip(w, "e4m3").to(w.dtype).float()
        xm = _round_trip(xs, "e4m3").to(xs.dtype).float()
    grad_x = (g @ wm).to(x.dtype)
    grad_w = (g.reshape(-1, 32).t() @ xm.reshape(-1, 64)).to(w.dtype)
    return grad_x, grad_w


@pytest.mark.parametrize("mode", [None, "high_precision", "dequantized"])
def test_the_backward_follows_te_s_override(monkeypatch, mode):
    layer, x, grad, y = _run(monkeypatch, mode, CURRENT)
    grad_x, grad_w = _reference(layer, x, grad, mode)
    assert torch.equal(x.grad, grad_x)
    assert torch.equal(layer.weight.grad, grad_w)
    # the bias gradient is the high-precision sum in every mode (TE's fused bgrad)
    assert torch.equal(layer.bias.grad, grad.float().sum((0, 1)).to(torch.bfloat16))
    # the forward is TE's FP8 forward whatever the override
    expected = (_round_trip(x.detach(), "e4m3") @ _round_trip(layer.weight.detach(), "e4m3").t()
                + layer.bias.detach().float()).to(torch.bfloat16)
    assert torch.equal(y.detach(), expected)


def test_the_override_changes_the_gradients_it_says(monkeypatch):
    """Each mode gives other numbers than the FP8 backward (an override the emulation ignored
    would pass the reference of None only)."""
    grads = {mode: _run(monkeypatch, mode, CURRENT)[1].grad for mode in
             (None, "high_precision", "dequantized")}
    assert not torch.equal(grads[None], grads["high_precision"])
    assert not torch.equal(grads[None], grads["dequantized"])
    assert not torch.equal(grads["high_precision"], grads["dequantized"])


@pytest.mark.parametrize(("override", "recipe", "words"), [
    ("high_precision", FP8Recipe(), "applies to current scaling only"),
    ("dequantized", FP8Recipe(scaling="delayed", fp8_format="E4M3"), "DelayedScaling"),
    ("", CURRENT, "NVTE_BACKWARD_OVERRIDE='' is refused"),
    ("HIGH_PRECISION", CURRENT, "NVTE_BACKWARD_OVERRIDE='HIGH_PRECISION' is refused"),
])
def test_values_te_refuses_stop_the_forward_naming_the_variable(monkeypatch, override, recipe,
                                                                 words):
    with pytest.raises(RecipeError) as raised:
        _run(monkeypatch, override, recipe)
    message = str(raised.value)
    assert words in message and "NVTE_BACKWARD_OVERRIDE" in message and "\n" not in message


def test_outside_fp8_the_variable_changes_nothing(monkeypatch):
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "bogus")
    layer = EmulatedFP8Linear(16, 8)
    x = torch.randn(2, 16, requires_grad=True)
    layer(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(2, 8) @ layer.weight.detach())


def _te_with_override(monkeypatch, version: str, value: str | None):
    """The stand-in TE whose recipe classes carry `backward_override` defaulting to `value`, as
    TE >= 2.15's do after reading NVTE_BACKWARD_OVERRIDE at import, with TE's asserts
    (common/recipe/__init__.py:224-228, 275-276 at v2.15) as they reach a caller: TE's recipes
    are pydantic dataclasses, so a failed assert is pydantic's ValidationError, a ValueError
    reading "Assertion failed, ..." (TE 2.20.2 wheel, pydantic 2.11.7)."""
    import dataclasses
    import sys

    from tests.fake_te import install_fake_te

    install_fake_te(monkeypatch, version)
    recipe = sys.modules["transformer_engine.common.recipe"]

    def checked(cls, delayed: bool):
        def post_init(self) -> None:  # pydantic turns TE's asserts into a ValueError subclass
            if self.backward_override not in (None, "high_precision", "dequantized") or (
                    delayed and self.backward_override is not None):
                raise ValueError("Assertion failed, ")
        return dataclasses.make_dataclass(cls.__name__, [("backward_override", str | None,
                                                           dataclasses.field(default=value))],
                                          bases=(cls,), namespace={"__post_init__": post_init})

    monkeypatch.setattr(recipe, "DelayedScaling", checked(recipe.DelayedScaling, True))
    monkeypatch.setattr(recipe, "Float8CurrentScaling",
                        checked(recipe.Float8CurrentScaling, False))


@pytest.mark.parametrize(("value", "scaling", "refused"), [
    ("high_precision", "delayed", True), ("dequantized", "current", False),
    ("bogus", "current", True), (None, "delayed", False),
])
def test_the_te_backend_names_the_variable_before_te_s_assert(monkeypatch, value, scaling,
                                                                refused):
    """te_swap's TE recipe: where TE's own constructor would raise its bare 'Assertion failed' (what
    a GPU run saw, from Composer's DelayedScaling on every batch), one line naming the
    variable; where TE takes it, TE's recipe carries it."""
    import sys

    from foundry_fp8.te.backend import delayed_scaling_kwargs, to_te_recipe

    _te_with_override(monkeypatch, "2.20.2", value)
    recipe = FP8Recipe(scaling=scaling)
    te_recipe = sys.modules["transformer_engine.common.recipe"]
    te_class = te_recipe.DelayedScaling if scaling == "delayed" else te_recipe.Float8CurrentScaling
    if not refused:
        assert to_te_recipe(recipe).backward_override == value
        return
    with pytest.raises(ValueError, match="Assertion failed"):  # TE's own constructor
        te_class()
    for build in (to_te_recipe,) + ((delayed_scaling_kwargs,) if scaling == "delayed" else ()):
        with pytest.raises(RecipeError) as raised:
            build(recipe)
        assert "NVTE_BACKWARD_OVERRIDE=" in str(raised.value) and "\n" not in str(raised.value)


def test_a_te_older_than_the_variable_ignores_it(monkeypatch):
    """TE 2.14's recipes have no `backward_override`: the variable changes nothing there."""
    from foundry_fp8.te.backend import to_te_recipe
    from tests.fake_te import install_fake_te

    install_fake_te(monkeypatch, "2.14.0")
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "high_precision")
    assert to_te_recipe(FP8Recipe()).margin == 0


@pytest.mark.parametrize(("value", "given"), [
    ("high_precision", None), ("dequantized", {"amax_history_len": 8}), (None, None)])
def test_composer_s_own_recipe_builds_around_te_swap_s_current_scaling(monkeypatch, value,
                                                                        given):
    """Review s15: `backend: te` with current scaling under amp_fp8 and the variable set. te_swap
    enters TE's current-scaling autocast, but Composer's amp_fp8 still builds
    `DelayedScaling(**precision_config)` every batch (composer/core/precision.py:91-97), which
    TE >= 2.15 refuses under the variable: the run's first batch raised TE's bare
    'Assertion failed' (pydantic's ValidationError). te_swap now gives Composer's recipe `backward_override=None`."""
    import sys
    from types import SimpleNamespace

    from composer.core import precision

    from foundry_fp8.composer.te_swap import _keep_composer_recipe_buildable

    _te_with_override(monkeypatch, "2.20.2", value)
    delayed = sys.modules["transformer_engine.common.recipe"].DelayedScaling
    state = SimpleNamespace(precision_config=given, _precision_config=given)
    _keep_composer_recipe_buildable(state)
    if value is None:  # nothing to keep buildable: Composer's precision_config untouched
        assert state._precision_config is given
        return
    with pytest.raises(ValueError, match="Assertion failed"):  # what Composer built before, on every batch
        delayed(**(given or {}))
    built = delayed(**state._precision_config)  # what Composer builds now
    assert built.backward_override is None
    assert {k: v for k, v in state._precision_config.items() if k != "backward_override"} == (
        given or {"fp8_format": sys.modules["transformer_engine.common.recipe"].Format.HYBRID,
                  "amax_history_len": 16, "amax_compute_algo": "max"})
    assert "DelayedScaling(**precision_config)" in precision.__loader__.get_source(
        precision.__name__)  # the call this keeps buildable is still Composer's
