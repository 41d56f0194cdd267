"""fp8_stats' live warnings give the advice the report gives (QA B2 s24, after fc15195 and
2eafa2d): the keep-in-BF16 change names te_swap's edge blocks counted over the whole model, not
over the layers fp8_stats watches, a resume included; the persistent-overflow change raises the
margin the FP8 layers cast with by one. Each change is followed the way a user follows it: the
warning's YAML given to te_swap's own plan (`swap.plan_swap`), or the run cast again with it."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import yaml
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.monitor import FP8Monitor, MonitorConfig, Schedule, cast_mode
from foundry_fp8.options import SwapConfig
from foundry_fp8.recipe import FP8Recipe
from tests.three_blocks import ThreeBlocks, kept_by_te_swap

#: fp8_stats watching the first two blocks of three (`layers: 'blocks\.[01]\.'`).
WATCH_TWO = MonitorConfig(layers=r"blocks\.[01]\.", tensors=("weight",))
def _log(monitor: FP8Monitor, model: nn.Module, step: int) -> None:
    monitor.start_step(step)
    model(torch.randn(8, 16)).sum().backward()
    monitor.finish_step()


def _change(warning: str) -> dict[str, object]:
    """The te_swap option a warning tells the user to set, and its value (`fp8_recipe.margin`
    dotted), read with a YAML reader as the user's config is."""
    text = (warning.rsplit("Change: ", 1)[1] if "Change: " in warning else
            warning.rsplit("where te_swap would convert it: ", 1)[1].removesuffix(")"))
    [(path, value)] = yaml.safe_load(text).items()
    assert path.startswith(f"{SwapConfig.PATH}."), warning
    return {path.removeprefix(f"{SwapConfig.PATH}."): value}

def _outlier_warning(monitor: FP8Monitor, model: ThreeBlocks, warned: list[str], step: int) -> str:
    with torch.no_grad():
        model.blocks[1].fc.weight[0, 0] = 1e6  # current scaling flushes the rest to 0
    _log(monitor, model, step)
    [warning] = warned
    assert "layer 'blocks.1.fc'" in warning and "underflow_pct" in warning, warning
    return warning


def test_a_middle_block_watched_last_is_told_its_own_exclude():
    model, warned = ThreeBlocks(), []
    monitor = FP8Monitor(model, WATCH_TWO, on_warning=warned.append)
    warning = _outlier_warning(monitor, model, warned, 0)
    change = _change(warning)
    assert change == {"exclude": r"^(?:model\.)?(?:transformer\.)?blocks\.1\.fc(?:\..+)?$"}, warning  # was keep_last_blocks: 1
    assert kept_by_te_swap(model, change) == {"blocks.1.fc"}
    assert kept_by_te_swap(model, {"keep_last_blocks": 1}) == {"blocks.2.fc"}  # the old advice


def test_a_resumed_monitor_keeps_the_models_blocks():
    """fp8_stats' resume restores the tracker into a monitor built afresh on the model."""
    model, warned = ThreeBlocks(), []
    before = FP8Monitor(model, WATCH_TWO, on_warning=warned.append, schedule=Schedule(interval=1))
    _log(before, model, 0)
    assert not warned
    after = FP8Monitor(model, WATCH_TWO, on_warning=warned.append, schedule=Schedule(interval=1))
    assert after.load_state_dict(before.state_dict()) == []
    assert _change(_outlier_warning(after, model, warned, 1)) == {"exclude": r"^(?:model\.)?(?:transformer\.)?blocks\.1\.fc(?:\..+)?$"}


def _overflow_changes(margin: int, growth: float = 3.0, steps: int = 8) -> list[str]:
    """The live persistent-overflow warnings of one FP8 layer (emulated delayed scaling at
    `margin`, history 16, max) whose input grows by `growth` a step: TE's scale trails the amax
    by growth / 2**margin, 1.5 at margin 1 (test_b24_margin_advice)."""
    torch.manual_seed(0)
    layer, base = nn.Sequential(EmulatedFP8Linear(16, 16)), torch.randn(16, 16)
    warned: list[str] = []
    monitor = FP8Monitor(layer, MonitorConfig(tensors=("activation",)), on_warning=warned.append,
                         schedule=Schedule(interval=1))
    recipe = FP8Recipe(scaling="delayed", amax_history_len=16, amax_compute_algo="max",
                       margin=margin)
    for step in range(steps):
        monitor.start_step(step)
        with fp8_autocast(recipe=recipe):
            layer(base * growth**step).sum().backward()
        monitor.finish_step()
    return [w for w in warned if "keeps outgrowing its delayed scale" in w]


@pytest.mark.parametrize("margin", [0, 1])
def test_the_live_overflow_advice_raises_the_runs_own_margin(margin):
    [warning] = _overflow_changes(margin, growth=1.5 * 2**margin)
    assert warning.startswith("FP8 activation of layer '0' at step"), warning
    assert _change(warning) == {"fp8_recipe.margin": margin + 1}  # was margin: 1 at margin 1
    assert not _overflow_changes(margin + 1, growth=1.5 * 2**margin)  # followed: cleared


class _TELinear(nn.Linear):
    """A te.Linear as the monitor tells one (`probe.te_class_name`)."""


_TELinear.__name__ = _TELinear.__qualname__ = "Linear"
_TELinear.__module__ = "transformer_engine.pytorch.module.linear"


def test_a_te_layer_casts_with_the_margin_of_tes_recipe_in_force(monkeypatch):
    """TE's DelayedScaling.margin (common/recipe/__init__.py:253 v2.18), read where the monitor
    reads the recipe (FP8GlobalStateManager.get_fp8_recipe), as for the emulated layers."""
    recipe = type("DelayedScaling", (), {"fp8_format": types.SimpleNamespace(name="HYBRID"),
                                         "margin": 2})()
    fake = types.ModuleType("transformer_engine.pytorch.quantization")
    fake.FP8GlobalStateManager = type("FP8GlobalStateManager", (), {
        "is_fp8_enabled": staticmethod(lambda: True), "get_fp8_recipe": staticmethod(lambda: recipe)})
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    mode = cast_mode(_TELinear(16, 16))
    assert mode is not None and mode.delayed and mode.margin == 2
