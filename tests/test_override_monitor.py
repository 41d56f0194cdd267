"""fp8_stats and fp8_guard under NVTE_BACKWARD_OVERRIDE (TE >= 2.15): under current scaling a
te.Linear's backward then runs without FP8 (the recipe's `backward_override` read in the forward,
pytorch/module/linear.py:1606 at v2.15; `ctx.fp8 = False`, no dY cast, module/base.py:1313), as
the emulated backend models it. The output gradient's FP8 numbers are then a what-if: logged
per layer, never flagged, summarised or acted on by fp8_guard; its NaN/Inf still count.

The reference is written here with torch's own FP8 dtype: TE's current-scaling cast (scale =
fp8_max / amax, recipe_common.cuh:31; E5M2 for the gradient under HYBRID), and the share of
finite nonzero elements that come back 0.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.health import layer_key, summary_key
from foundry_fp8.monitor import FP8Monitor, MonitorConfig
from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.shapes import FP8_DIM_MULTIPLE
from tests.test_monitor_modules import _FakeStateManager

CURRENT = FP8Recipe(scaling="current")
D = 16
# dY of the layer: channel 0 is 1, the others 1e-12, past E5M2's range (2^15.8 / 2^-16) under
# one current scale: 15 of every 16 elements flush to 0 when cast
WEIGHTS = torch.tensor([1.0] + [1e-12] * (D - 1))
# rows (tokens) of each GEMM: what real TE's FP8 backward on Hopper needs of the
# weight-gradient GEMM's inner dim (the emulation warns of fewer: emulate._warn_unless_te_runs)
TOKENS = FP8_DIM_MULTIPLE
# batches of `_fit`'s run, one epoch
BATCHES = 6


def _underflow_pct(t: torch.Tensor) -> float:
    """% of finite nonzero elements that TE's current-scaling E5M2 cast flushes to 0."""
    t = t.double()
    scale = 57344.0 / t.abs().max()
    q = (t.float() * scale.float()).clamp(-57344.0, 57344.0).to(torch.float8_e5m2).float()
    nonzero = t != 0
    return 100.0 * float(((q == 0) & nonzero).sum()) / float(nonzero.sum())


def _monitored(monkeypatch, override: str | None):
    """A one-layer emulated model under the variable (unset: None), its monitor and warnings."""
    if override is None:
        monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)
    else:
        monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", override)
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(D, D, bias=False))
    warned: list[str] = []
    return model, FP8Monitor(model, MonitorConfig(), on_warning=warned.append), warned


def _step(monkeypatch, override: str | None, nan: bool = False):
    model, monitor, warned = _monitored(monkeypatch, override)
    x = torch.randn(TOKENS, D)
    grad = WEIGHTS.expand(TOKENS, D).clone()
    if nan:
        grad[3, 5] = float("nan")
    monitor.start_step()
    with fp8_autocast(recipe=CURRENT):
        y = model(x)
    y.backward(grad)
    return monitor, monitor.finish_step(), warned, grad


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_the_gradient_the_override_does_not_cast_is_a_whatif_never_acted_on(monkeypatch,
                                                                            override):
    monitor, metrics, warned, grad = _step(monkeypatch, override)
    want = _underflow_pct(grad)
    assert want == pytest.approx(100.0 * 15 / 16)
    key = ("0", "gradient")
    # logged per layer, as the what-if of a layer not in FP8
    assert metrics[layer_key("underflow_pct", "gradient", "0")] == pytest.approx(want)
    assert metrics[layer_key("amax", "gradient", "0")] == 1.0
    assert key in monitor.whatif_rows and monitor.uncast_rows == {key}
    # ... and never acted on: no warning, no summary, no guard input beyond the tensor's own
    assert warned == []
    assert summary_key("gradient", "worst_underflow_pct") not in metrics  # no cast counted
    assert metrics[summary_key("gradient", "flagged_layers")] == 0.0
    assert metrics[summary_key(None, "flagged_layers")] == 0.0
    assert key not in monitor.judged
    assert monitor.judged[("0", "activation")] == monitor.table[("0", "activation")]
    assert key not in monitor.tracker.worst and "gradient" not in monitor.summary()


def test_without_the_override_the_same_gradient_is_cast_and_flagged(monkeypatch):
    monitor, metrics, warned, grad = _step(monkeypatch, None)
    want = _underflow_pct(grad)
    assert metrics[layer_key("underflow_pct", "gradient", "0")] == pytest.approx(want)
    assert metrics[summary_key("gradient", "worst_underflow_pct")] == pytest.approx(want)
    assert metrics[summary_key("gradient", "flagged_layers")] == 1.0
    assert monitor.uncast_rows == set() and ("0", "gradient") not in monitor.whatif_rows
    assert len(warned) == 1 and warned[0].startswith("FP8 gradient of layer '0' at step 0: underflow_pct 93.8 %")
    assert monitor.judged == monitor.table


def test_nan_in_the_uncast_gradient_still_warns_and_counts(monkeypatch):
    monitor, metrics, warned, _ = _step(monkeypatch, "high_precision", nan=True)
    assert metrics[summary_key("gradient", "nonfinite")] == 1.0
    assert monitor.judged[("0", "gradient")] == {
        "amax": 1.0, "amin": pytest.approx(1e-12), "nan_count": 1.0, "inf_count": 0.0}
    assert len(warned) == 1 and "1 NaN and 0 Inf elements" in warned[0]


@pytest.mark.parametrize("override", [None, "high_precision"])
def test_a_fallback_layers_gradient_holds_back_no_repromotion_under_the_override(monkeypatch,
                                                                                 override):
    """fp8_guard re-promotes a layer when its what-if rows have been healthy; back in FP8 under
    the override its dY would still not be cast, so that row is not among them."""
    if override is None:
        monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)
    else:
        monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", override)
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(D, D, bias=False), EmulatedFP8Linear(D, D, bias=False))
    monitor = FP8Monitor(model, MonitorConfig(), on_warning=lambda _: None)
    monitor.start_step()
    with fp8_autocast(recipe=CURRENT):
        h = model[0](torch.randn(TOKENS, D))
        with fp8_autocast(enabled=False):  # as fp8_guard runs a layer in fallback
            y = model[1](h)
    y.backward(WEIGHTS.expand(TOKENS, D))
    metrics = monitor.finish_step(fallbacks={"1"})
    fallen = ("1", "gradient")
    assert metrics[layer_key("underflow_pct", "gradient", "1")] == pytest.approx(
        _underflow_pct(WEIGHTS.expand(TOKENS, D)))
    assert fallen in monitor.fallback_rows
    assert (fallen in monitor.judged) is (override is None)


@pytest.mark.parametrize("override", [None, "high_precision"])
def test_a_fallen_layers_gradient_is_not_judged_when_every_layer_is_in_fallback(monkeypatch,
                                                                               override):
    """No layer in FP8 this step (a one-layer model in fallback since a resume): the override
    is still in force for the layer once back in FP8, so its dY's what-if holds nothing back."""
    model, monitor, warned = _monitored(monkeypatch, override)
    monitor.start_step()
    with fp8_autocast(recipe=CURRENT), fp8_autocast(enabled=False):
        y = model(torch.randn(TOKENS, D))
    y.backward(WEIGHTS.expand(TOKENS, D))
    metrics = monitor.finish_step(fallbacks={"0"})
    fallen = ("0", "gradient")
    assert metrics[layer_key("underflow_pct", "gradient", "0")] == pytest.approx(
        _underflow_pct(WEIGHTS.expand(TOKENS, D)))
    assert (fallen in monitor.judged) is (override is None)
    assert (fallen in monitor.uncast_rows) is (override is not None)
    assert sum("underflow_pct" in w for w in warned) == int(override is None)


@pytest.mark.parametrize("override", [None, "high_precision"])
def test_the_override_of_the_recipe_the_layers_ran_under_holds_once_all_fell_back(monkeypatch,
                                                                                 override):
    """TE reads NVTE_BACKWARD_OVERRIDE into its recipe when imported: the recipe's field, seen
    while a layer ran in FP8, decides for the steps where every layer is in fallback."""
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)
    fake = types.ModuleType("transformer_engine.pytorch.quantization")
    fake.FP8GlobalStateManager = _StateManager
    monkeypatch.setitem(__import__("sys").modules, fake.__name__, fake)
    recipe = type("Float8CurrentScaling", (), {"fp8_format": types.SimpleNamespace(name="HYBRID"),
                                               "backward_override": override})()
    monkeypatch.setattr(_StateManager, "recipe", recipe)
    torch.manual_seed(0)
    model = nn.Sequential(_TELinear(D, D, bias=False))
    monitor = FP8Monitor(model, MonitorConfig(), on_warning=lambda _: None)
    fallen = ("0", "gradient")
    for enabled in (True, False):  # in FP8, then in fallback
        monkeypatch.setattr(_StateManager, "enabled", enabled)
        monitor.start_step()
        model(torch.randn(TOKENS, D)).backward(WEIGHTS.expand(TOKENS, D))
        monitor.finish_step(fallbacks=set() if enabled else {"0"})
        assert (fallen in monitor.uncast_rows) is (override is not None)
    assert fallen in monitor.fallback_rows
    assert monitor.judged.get(fallen, {}).get("underflow_pct") == (
        pytest.approx(_underflow_pct(WEIGHTS.expand(TOKENS, D))) if override is None else None)


class _StateManager(_FakeStateManager):
    """test_monitor_modules' stand-in for TE's FP8GlobalStateManager, its recipe set per test."""

    recipe: object = None


class _TELinear(nn.Linear):
    pass


_TELinear.__name__ = _TELinear.__qualname__ = "Linear"
_TELinear.__module__ = "transformer_engine.pytorch.module.linear"


@pytest.mark.parametrize(("fields", "cast"), [
    ({"backward_override": "high_precision"}, False), ({"backward_override": "dequantized"}, False),
    ({"backward_override": None}, True), ({}, True)],  # {}: TE < 2.15, no such field
    ids=["high_precision", "dequantized", "unset", "te-2.14"])
def test_a_te_recipes_backward_override_decides_whether_dy_is_cast(monkeypatch, fields, cast):
    fake = types.ModuleType("transformer_engine.pytorch.quantization")
    fake.FP8GlobalStateManager = _StateManager
    monkeypatch.setitem(__import__("sys").modules, fake.__name__, fake)
    recipe = type("Float8CurrentScaling", (), {"fp8_format": types.SimpleNamespace(name="HYBRID"),
                                               **fields})()
    monkeypatch.setattr(_StateManager, "recipe", recipe)
    torch.manual_seed(0)
    model = nn.Sequential(_TELinear(D, D, bias=False))
    warned: list[str] = []
    monitor = FP8Monitor(model, MonitorConfig(), on_warning=warned.append)
    monitor.start_step()
    model(torch.randn(TOKENS, D)).backward(WEIGHTS.expand(TOKENS, D))
    metrics = monitor.finish_step()
    want = _underflow_pct(WEIGHTS.expand(TOKENS, D))
    assert metrics[layer_key("underflow_pct", "gradient", "0")] == pytest.approx(want)
    assert metrics.get(summary_key("gradient", "worst_underflow_pct")) == (
        pytest.approx(want) if cast else None)
    assert (("0", "gradient") in monitor.uncast_rows) is not cast
    assert len(warned) == int(cast)


class _Blocks(nn.Module):
    """One transformer block as te_swap finds them (`blocks.<n>`), a linear layer."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(D, D)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


def _fit(tmp_path, monkeypatch, override: str | None):
    """te_swap (emulated, current scaling) + fp8_stats + fp8_guard in Composer: a block whose dY
    holds WEIGHTS in each of a batch's TOKENS rows (the loss weighs its outputs by them),
    learning rate 0, BATCHES batches."""
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.guard import FP8Guard
    from foundry_fp8.composer.jsonl_logger import JSONLLogger
    from foundry_fp8.composer.stats import FP8Stats
    from foundry_fp8.composer.te_swap import TESwap
    from foundry_fp8.jsonl import read_jsonl

    if override is None:
        monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)
    else:
        monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", override)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(BATCHES * TOKENS, D),
                         torch.zeros(BATCHES * TOKENS, dtype=torch.long))
    model = ComposerClassifier(_Blocks(), num_classes=D,
                               loss_fn=lambda out, _: (out.float() * WEIGHTS).sum())
    guard = FP8Guard(consecutive=2, max_fallback_share=1.0)
    trainer = Trainer(
        model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0), run_name="run",
        train_dataloader=DataLoader(data, batch_size=TOKENS), max_duration=f"{BATCHES}ba",
        algorithms=[TESwap(backend="emulate", fp8_recipe={"scaling": "current"})],
        callbacks=[FP8Stats(interval=1, image_interval=None), guard],
        loggers=[JSONLLogger(path=str(tmp_path / "metrics.jsonl"))], device="cpu",
        progress_bar=False)
    trainer.fit()
    trainer.close()
    series: dict[int, dict[str, float]] = {}
    for step, metrics in read_jsonl(tmp_path / "metrics.jsonl"):
        series.setdefault(step, {}).update(metrics)
    return guard, series


LAYER = "module.blocks.0"


def test_fp8_guard_moves_no_layer_for_a_cast_the_override_skips(tmp_path, monkeypatch):
    """Without the override the block's FP8 dY flushes 15 of 16 elements and fp8_guard moves it
    at the second judged step; with it, no cast happens and nothing moves, while the what-if
    series still says what the cast would do."""
    want = _underflow_pct(WEIGHTS.expand(TOKENS, D))
    guard, series = _fit(tmp_path / "fp8", monkeypatch, None)
    assert list(guard.core.fallbacks) == [LAYER] and guard.core.fallbacks[LAYER].step == 1
    guard, series = _fit(tmp_path / "override", monkeypatch, "high_precision")
    assert guard.core.fallbacks == {}
    underflow = [m[layer_key("underflow_pct", "gradient", LAYER)] for m in series.values()
                 if layer_key("underflow_pct", "gradient", LAYER) in m]
    assert underflow == [pytest.approx(want)] * BATCHES
    # no dY is cast: no worst value over casts at any step (`flagged_layers` is still logged)
    assert not [m for m in series.values() if summary_key("gradient", "worst_underflow_pct") in m]
    assert all(m[summary_key("gradient", "flagged_layers")] == 0.0
               for m in series.values() if summary_key("gradient", "flagged_layers") in m)
