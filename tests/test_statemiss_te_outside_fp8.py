"""fp8_state on a TE module that runs outside Composer's `amp_fp8` (LLM-Foundry's `fc_type: te`
under `precision: amp_bf16`, beside te_swap's emulated layers). TE creates a module's scaling
state only in a forward under its FP8 autocast (TE 2.20.2 pytorch/module/base.py:1543-1552), so
such a module saves none; fp8_state called it "in FP8 now without saved state" and, under its
default `strict`, refused every resume of the run. It is judged as fp8_guard judges it
(`swap.would_run_fp8`): under amp_fp8 a TE module without saved state is still refused.

The TE stand-in is `tests.test_state_callback._LazyStateLinear` (TE's lazy state: none until a
forward with FP8 on)."""

from __future__ import annotations

import logging

import pytest
import torch
from composer.core import Precision
from composer.models import ComposerClassifier
from torch import nn

from foundry_fp8.composer.state import FP8State, FP8StateError, fp8_state_from_checkpoint
from foundry_fp8.emulate import EmulatedFP8Linear
from foundry_fp8.fp8_meta import fp8_modules, read_fp8_meta
from tests.test_state_callback import _LazyStateLinear
from tests.test_state_restore import HISTORY, LOGGER, TwoBlocks, _callback, _checkpoint, _step
from tests.test_state_restore import _trainer as _run


class _BesideTE(nn.Module):
    """An emulated FP8 layer and a TE layer built into the model, as `fc_type: te` builds it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emulated, self.te = EmulatedFP8Linear(16, 16), _LazyStateLinear(HISTORY)

    def forward(self, x):
        h = self.emulated(x)
        return h + self.te(h[:, :4]).repeat(1, 4)


def _saved_under(precision: Precision) -> dict:
    """fp8_state's entry after two FP8 steps of `_BesideTE` under `precision` (TE's FP8 on
    only under amp_fp8, as Composer's autocast turns it on)."""
    model = _BesideTE()
    model.te.fp8_on = precision == Precision.AMP_FP8
    for seed in range(2):
        _step(model, seed=seed)
    return _callback(model, precision=precision).state_dict()


@pytest.mark.parametrize("precision", [Precision.AMP_BF16, Precision.FP32])
def test_a_te_module_outside_amp_fp8_is_not_missing_its_state(precision, caplog):
    saved = _saved_under(precision)
    assert sorted(saved["modules"]) == ["emulated"]  # TE saved none: it never ran in FP8
    model = _BesideTE()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _callback(model, precision=precision).load_state_dict(saved)  # strict
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "restored amax history and scales of 1 modules" in caplog.text
    restored = read_fp8_meta(model.emulated)
    assert all(torch.equal(restored[k][1:] if k.endswith("history") else restored[k],
                           v[1:] if k.endswith("history") else v)
               for k, v in saved["modules"]["emulated"].items())
    assert read_fp8_meta(model.te) == {} and not model.te._forward_pre_hooks  # untouched


def test_under_amp_fp8_a_te_module_without_saved_state_is_still_refused():
    with pytest.raises(FP8StateError, match=r"1 in FP8 now without saved state: te; 0 saved"):
        _callback(_BesideTE()).load_state_dict(_saved_under(Precision.AMP_BF16))


@pytest.mark.parametrize(("precision", "warned"), [(Precision.AMP_BF16, False),
                                                   (Precision.AMP_FP8, True)])
def test_a_te_only_run_outside_amp_fp8_is_not_told_its_fp8_state_starts_fresh(
        precision, warned, caplog):
    """Its own checkpoint holds no FP8 state, as expected: not "saved by a run without FP8
    modules ... as expected when converting a bf16 checkpoint" at every resume."""
    model = nn.Sequential(_LazyStateLinear(HISTORY))
    saved = _callback(model, recipe=None, precision=precision).state_dict()
    assert saved["modules"] == {}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _callback(model, recipe=None, precision=precision).load_state_dict(saved)
    assert ("the checkpoint holds no FP8 state" in caplog.text) is warned


class _BlocksBesideTE(TwoBlocks):
    """te_swap's emulated `blocks` and a TE layer of the model's own."""

    def __init__(self):
        super().__init__()
        self.te = _LazyStateLinear(HISTORY)

    def forward(self, x):
        h = super().forward(x)
        return h + self.te(h[:, :4]).repeat(1, 4)


def test_a_real_amp_bf16_resume_with_a_te_layer_restores_and_trains_on(tmp_path, monkeypatch):
    """Composer's own save and load, strict fp8_state. Composer refuses amp_bf16 on a CPU
    (core/precision.py `_validate_precision`); on a CPU its context is no autocast at all
    (`get_precision_context`), so the check is lifted and the run is Composer's otherwise."""
    monkeypatch.setattr("composer.trainer.trainer._validate_precision", lambda *args: None)
    _run(tmp_path, "2ba", [FP8State()], model=ComposerClassifier(_BlocksBesideTE(), 16),
         precision="amp_bf16").fit()
    checkpoint = _checkpoint(tmp_path, 2)
    saved = fp8_state_from_checkpoint(checkpoint)
    assert sorted(saved) == ["module.blocks.0", "module.blocks.1"]
    model = ComposerClassifier(_BlocksBesideTE(), 16)
    trainer = _run(tmp_path / "resumed", "4ba", [FP8State()], model=model, precision="amp_bf16",
                   load_path=str(checkpoint))
    assert trainer.state.precision == Precision.AMP_BF16
    assert sorted(n for n, _ in fp8_modules(model)) == [*saved, "module.te"]
    assert isinstance(model.module.te, _LazyStateLinear)  # not te_swap's
    for name, module in fp8_modules(model):
        if name in saved:  # the scales two steps made, restored
            assert not torch.equal(saved[name]["fwd_scale"], torch.ones(3))
            assert torch.equal(read_fp8_meta(module)["fwd_scale"], saved[name]["fwd_scale"])
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 4
    assert read_fp8_meta(model.module.te) == {} and not model.module.te._forward_pre_hooks
