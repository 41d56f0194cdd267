"""fp8_state when the checkpoint's precision is not the resumed run's, and on a checkpoint saved
without fp8_state, through Composer's own save and load.

TE computes in FP8 only under Composer's amp_fp8 (`swap.would_run_fp8`), so a TE layer built
into the model (`fc_type: te`) saves FP8 state under amp_fp8 and none under amp_bf16. Switching
the precision between save and resume was read as te_swap's layers having changed (amp_bf16 ->
amp_fp8: refused under the default `strict`, naming include/exclude), or said nothing while the
log claimed the layer restored (amp_fp8 -> amp_bf16). The TE stand-in is
`tests.test_state_callback._LazyStateLinear` (TE's lazy state: none until a forward with FP8
on); Composer refuses amp_bf16 and amp_fp8 on a CPU (core/precision.py `_validate_precision`),
so that check is lifted: the checkpoint loads at Trainer init, before any FP8 forward."""

from __future__ import annotations

import logging

import pytest
import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.models import ComposerClassifier
from torch import nn

from foundry_fp8.composer.state import FP8State, fp8_state_from_checkpoint
from foundry_fp8.fp8_meta import read_fp8_meta
from tests.test_state_callback import _LazyStateLinear
from tests.test_state_restore import HISTORY, LOGGER, _checkpoint, _ours
from tests.test_state_restore import _trainer as _run
from tests.test_statemiss_te_outside_fp8 import _BlocksBesideTE

RESTORED = "fp8_state: restored amax history and scales of {} modules"


@pytest.fixture(autouse=True)
def _any_precision_on_cpu(monkeypatch):
    monkeypatch.setattr("composer.trainer.trainer._validate_precision", lambda *args: None)


class _Updated(Callback):
    """A delayed-scaling update of the TE stand-in's forward scales after each batch (the
    stand-in keeps TE's lazy state but runs no update), so its saved state is not TE's fresh
    one."""

    def batch_end(self, state: State, logger: Logger) -> None:
        state.model.module.te.fp8_meta["scaling_fwd"].scale.fill_(2.0)


def _saved(folder, te_in_fp8: bool, callbacks=None) -> str:
    """Two amp_bf16 batches of the emulated blocks beside a TE layer; `te_in_fp8`: the TE layer
    runs in FP8 as under amp_fp8 (its state saved), else as under amp_bf16 (none)."""
    model = ComposerClassifier(_BlocksBesideTE(), 16)
    model.module.te.fp8_on = te_in_fp8
    _run(folder, "2ba", [FP8State()] if callbacks is None else callbacks, model=model,
         precision="amp_bf16").fit()
    return str(_checkpoint(folder, 2))


def test_amp_bf16_to_amp_fp8_names_the_precision_not_te_swaps_layers(tmp_path, caplog):
    checkpoint = _saved(tmp_path, te_in_fp8=False)
    assert sorted(fp8_state_from_checkpoint(checkpoint)) == ["module.blocks.0",
                                                             "module.blocks.1"]
    model = ComposerClassifier(_BlocksBesideTE(), 16)
    with caplog.at_level(logging.INFO, logger=LOGGER):  # strict: it refused before
        _run(tmp_path / "resumed", "4ba", [FP8State()], model=model, precision="amp_fp8",
             load_path=checkpoint)
    assert _ours(caplog) == [
        "fp8_state: precision amp_bf16 -> amp_fp8 since the checkpoint: 1 TE module(s) run in "
        "FP8 now and start FP8 scaling fresh (they saved none): module.te"]
    assert RESTORED.format(2) in caplog.text
    assert read_fp8_meta(model.module.te) == {} and not model.module.te._forward_pre_hooks


@pytest.mark.parametrize(("saved_under", "said"), [
    ("amp_fp8", "precision amp_fp8 -> amp_bf16 since the checkpoint"),
    ("amp_bf16", "under this run's precision amp_bf16")])
def test_amp_fp8_to_amp_bf16_says_the_te_layer_is_out_of_fp8_and_keeps_its_state(
        tmp_path, caplog, saved_under, said):
    """`saved_under`: the precision in the checkpoint's Composer metadata (amp_fp8 written in:
    Composer cannot train under amp_fp8 on a CPU)."""
    checkpoint = _saved(tmp_path, te_in_fp8=True, callbacks=[FP8State(), _Updated()])
    whole = torch.load(checkpoint, weights_only=False)
    whole["state"]["metadata"]["precision"] = saved_under
    torch.save(whole, checkpoint)
    saved = fp8_state_from_checkpoint(checkpoint)["module.te"]
    assert torch.equal(saved["fwd_scale"], torch.full((3,), 2.0))
    model = ComposerClassifier(_BlocksBesideTE(), 16)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        trainer = _run(tmp_path / "resumed", "4ba", [FP8State()], model=model,
                       precision="amp_bf16", load_path=checkpoint)
    assert _ours(caplog) == [
        f"fp8_state: {said}: 1 TE module(s) do not run in FP8 now, "
        "their saved FP8 scales and amax histories kept unused for a later amp_fp8 resume: "
        "module.te"]
    assert RESTORED.format(2) in caplog.text  # not 3: the TE layer's was not restored
    trainer.fit()
    assert read_fp8_meta(model.module.te) == {}
    kept = fp8_state_from_checkpoint(_checkpoint(tmp_path / "resumed", 4))["module.te"]
    assert all(torch.equal(kept[k], saved[k]) for k in saved)


def _te_only() -> ComposerClassifier:
    """A TE layer between torch layers, no te_swap: under amp_bf16 nothing computes in FP8."""
    return ComposerClassifier(nn.Sequential(nn.Linear(16, 4), _LazyStateLinear(HISTORY),
                                            nn.Linear(4, 16)), 16)


def test_a_te_only_run_under_amp_bf16_is_not_told_fp8_scaling_starts_fresh(tmp_path, caplog):
    """A checkpoint without fp8_state's entry, loaded into a run whose TE layer never computes
    in FP8: nothing of FP8 to start fresh."""
    _run(tmp_path, "2ba", [], history=None, model=_te_only(), precision="amp_bf16").fit()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _run(tmp_path / "resumed", "4ba", [FP8State()], history=None, model=_te_only(),
             precision="amp_bf16", load_path=str(_checkpoint(tmp_path, 2)))
    assert _ours(caplog) == []


def test_an_fp8_runs_checkpoint_without_fp8_state_is_not_called_a_bf16_conversion(tmp_path,
                                                                                    caplog):
    """te_swap's emulated run saved without fp8_state: its FP8 state is lost, which is not "as
    expected when converting a bf16 checkpoint"."""
    _run(tmp_path, "2ba", []).fit()
    checkpoint = str(_checkpoint(tmp_path, 2))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _run(tmp_path / "resumed", "4ba", [FP8State()], load_path=checkpoint)
    assert _ours(caplog) == [
        f"fp8_state: {checkpoint} holds no FP8 state though its run computed in FP8 (te_swap "
        "or amp_fp8; saved without fp8_state, or left out by load_ignore_keys); FP8 scales and "
        "amax histories start fresh, not continued from that run"]
