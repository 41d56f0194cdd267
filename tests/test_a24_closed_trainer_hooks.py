"""fp8_state's hooks leave the model with its Trainer (Composer's `Trainer.close`): a notebook or
a sweep trains one model in several Trainers, and saves it itself after."""

from __future__ import annotations

import pickle

import torch
from composer import Trainer
from composer.models import ComposerClassifier
from torch import nn

from foundry_fp8.composer.state import FP8State
from foundry_fp8.fp8_meta import read_fp8_meta
from tests.test_state_callback import SAVED, PickledExtraStateLinear, _LazyStateLinear


def _extra_state_is_inert(model: nn.Module) -> bool:
    saved = model.state_dict()["module.0._extra_state"]
    return pickle.loads(saved.numpy().tobytes()) is None


def _state_dict_hooks(model: nn.Module) -> int:
    return sum(len(m._state_dict_hooks) for m in model.modules())


def test_each_closed_trainer_takes_its_inert_extra_state_hooks_off_the_model():
    """fp8_state saves TE modules' `_extra_state` as a pickled None while its Trainer lives. The
    hook stayed after `close`, one more per module for each Trainer built on the model (3 after
    3 Trainers), and the user's own `model.state_dict()` after training lost TE's state."""
    model = ComposerClassifier(nn.Sequential(PickledExtraStateLinear(16, 16)), num_classes=16)
    assert not _extra_state_is_inert(model) and _state_dict_hooks(model) == 0
    for _ in range(3):
        trainer = Trainer(model=model, callbacks=[FP8State()], device="cpu", loggers=[],
                          progress_bar=False)
        assert _extra_state_is_inert(model)  # what its checkpoints hold
        trainer.close()
        assert _state_dict_hooks(model) == 0
        assert not _extra_state_is_inert(model)  # TE's own save again


def test_a_restore_that_met_no_fp8_forward_does_not_outlive_its_trainer():
    """A Trainer that loaded FP8 state and ran no FP8 forward (evaluation only) left its restore
    hook on the TE module: the next Trainer's first FP8 forward wrote the old checkpoint's
    scales into that module."""
    module = _LazyStateLinear(history_len=4)
    callback = FP8State()
    callback._model = nn.Sequential(module)
    callback.load_state_dict({"modules": {"0": SAVED}})  # Composer's load, applied at FIT_START
    callback._model(torch.randn(2, 4))  # an eval forward: FP8 off, the restore waits
    assert module._forward_pre_hooks
    callback.close(None, None)  # Composer's Engine._close: (state, logger)
    assert not module._forward_pre_hooks
    module.fp8_on = True
    module(torch.randn(2, 4))  # a later Trainer's first FP8 forward: TE's fresh state
    assert torch.equal(read_fp8_meta(module)["fwd_scale"], torch.ones(3))
