"""A TE module whose restore still waits for its first FP8 forward when the next checkpoint is
saved (QA Q6 s22). TE creates a module's scaling state in its first FP8 forward (TE 2.20
pytorch/module/base.py `init_fp8_metadata`), so fp8_state writes the saved state then; a layer
that fp8_guard holds in high precision since the resume (TE's disabled region,
`te.backend.te_high_precision`) has none before. fp8_state saved only the state a module holds,
so the next checkpoint lost that layer's scales and histories: its resume stopped under the
default `strict` (`1 in FP8 now without saved state`, blaming te_swap's selection), and where
every module waited, it was read as "saved by a run without FP8 modules". Through Composer's own
save and load (`load_path`), three attempts of one run, with `tests.test_state_callback`'s
stand-in for TE's lazy state."""

from __future__ import annotations

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.models import ComposerClassifier
from torch import nn

from foundry_fp8.composer.state import FP8State, fp8_state_from_checkpoint
from foundry_fp8.fp8_meta import read_fp8_meta, write_fp8_meta
from tests.test_state_callback import SAVED, _LazyStateLinear
from tests.test_state_restore import _checkpoint, _trainer


class _Lazy(nn.Module):
    """Two TE-like modules (`a`, `b`) between the 16-wide ends `_trainer`'s data needs."""

    def __init__(self, a_fp8: bool, b_fp8: bool):
        super().__init__()
        self.up, self.down = nn.Linear(16, 4), nn.Linear(4, 16)
        self.a, self.b = _LazyStateLinear(4), _LazyStateLinear(4)
        self.a.fp8_on, self.b.fp8_on = a_fp8, b_fp8  # off: held in high precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.b(self.a(self.up(x))))


class _Trained(Callback):
    """The FP8 state a first attempt's training left: SAVED, written after every batch."""

    def batch_end(self, state: State, logger: Logger) -> None:
        for module in (state.model.module.a, state.model.module.b):
            write_fp8_meta(module, SAVED)


def _model(a_fp8: bool, b_fp8: bool) -> ComposerClassifier:
    return ComposerClassifier(_Lazy(a_fp8, b_fp8), num_classes=16)


def _equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return got.keys() == expected.keys() and all(torch.equal(got[k], v)
                                                 for k, v in expected.items())


def test_a_layer_held_out_of_fp8_since_the_resume_keeps_its_saved_state(tmp_path):
    _trainer(tmp_path, "2ba", [FP8State(), _Trained()], history=None,
             model=_model(True, True)).fit()
    # the second attempt: `b` held in high precision (fp8_guard's fallback), `a` in FP8
    _trainer(tmp_path, "4ba", [FP8State()], history=None, model=_model(True, False),
             load_path=str(_checkpoint(tmp_path, 2))).fit()
    saved = fp8_state_from_checkpoint(_checkpoint(tmp_path, 4))
    assert sorted(saved) == ["module.a", "module.b"]
    assert _equal(saved["module.b"], SAVED) and _equal(saved["module.a"], SAVED)
    # the third: default strict, both in FP8 again; `b` restored at its first FP8 forward
    model = _model(True, True)
    _trainer(tmp_path, "5ba", [FP8State()], history=None, model=model,
             load_path=str(_checkpoint(tmp_path, 4))).fit()
    assert _equal(read_fp8_meta(model.module.b), SAVED)


def test_a_checkpoint_saved_while_every_module_waits_is_not_read_as_a_bf16_runs(tmp_path):
    """Every module held out of FP8 since the resume: the next checkpoint held no FP8 state,
    and its resume said "saved by a run without FP8 modules" and started fresh."""
    _trainer(tmp_path, "2ba", [FP8State(), _Trained()], history=None,
             model=_model(True, True)).fit()
    _trainer(tmp_path, "4ba", [FP8State()], history=None, model=_model(False, False),
             load_path=str(_checkpoint(tmp_path, 2))).fit()
    saved = fp8_state_from_checkpoint(_checkpoint(tmp_path, 4))
    assert sorted(saved) == ["module.a", "module.b"]
    assert all(_equal(tensors, SAVED) for tensors in saved.values())


def test_a_module_restored_saves_its_own_state_not_the_checkpoints(tmp_path):
    """Once restored, the module's own state (changed by training) is what is saved."""
    _trainer(tmp_path, "2ba", [FP8State(), _Trained()], history=None,
             model=_model(True, True)).fit()
    model = _model(True, True)
    callback = FP8State()
    _trainer(tmp_path, "3ba", [callback], history=None, model=model,
             load_path=str(_checkpoint(tmp_path, 2))).fit()
    moved = {k: v * 2 for k, v in SAVED.items()}
    write_fp8_meta(model.module.a, moved)
    assert _equal(callback.state_dict()["modules"]["module.a"], moved)
