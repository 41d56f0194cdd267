"""A current-scaling run (`te_swap: {fp8_recipe: {scaling: current}}`) resumed from its own
checkpoint, under fp8_state's default `strict`, through Composer's own save and load.

fp8_state saved the emulated layers' empty histories padded to the recipe's default length (16
zero rows), as it does for a delayed-scaling layer before its first forward, and the resume
then refused them: "it holds delayed-scaling amax histories ..., this run's recipe keeps none".
Every resume of such a run stopped. Current scaling keeps no amax history (TE's
Float8CurrentScaling computes each scale from the tensor being cast)."""

from __future__ import annotations

import logging

import pytest
import torch

from foundry_fp8.composer.state import FP8State, fp8_state_from_checkpoint
from foundry_fp8.composer.te_swap import TESwap
from tests.test_state_restore import LOGGER, _checkpoint, _ours
from tests.test_state_restore import _trainer as _run

CURRENT = {"scaling": "current"}


@pytest.fixture(autouse=True)
def _current_scaling(monkeypatch):
    """`_trainer`'s te_swap, under current scaling."""
    monkeypatch.setattr("tests.test_state_restore.TESwap",
                        lambda backend, fp8_recipe: TESwap(backend=backend, fp8_recipe=CURRENT))


def test_a_current_scaling_run_resumes_from_its_own_checkpoint(tmp_path, caplog):
    _run(tmp_path, "2ba", [FP8State()]).fit()
    checkpoint = str(_checkpoint(tmp_path, 2))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        resumed = _run(tmp_path / "resumed", "3ba", [FP8State()], load_path=checkpoint)
        resumed.fit()
    assert int(resumed.state.timestamp.batch) == 3
    assert _ours(caplog) == []
    saved = fp8_state_from_checkpoint(checkpoint)
    assert sorted(saved) == ["module.blocks.0", "module.blocks.1"]
    assert all(t[k].shape[0] == 0 for t in saved.values() for k in t if k.endswith("history"))


def test_a_checkpoint_with_the_padded_histories_resumes_too(tmp_path, caplog):
    """A current-scaling checkpoint fp8_state saved before the fix: 16 zero rows each."""
    _run(tmp_path, "2ba", [FP8State()]).fit()
    checkpoint = str(_checkpoint(tmp_path, 2))
    whole = torch.load(checkpoint, weights_only=False)
    for tensors in whole["state"]["callbacks"]["FP8State"]["modules"].values():
        for key in [k for k in tensors if k.endswith("history")]:
            tensors[key] = torch.zeros(16, tensors[key].shape[1])
    torch.save(whole, checkpoint)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _run(tmp_path / "resumed", "3ba", [FP8State()], load_path=checkpoint).fit()
    assert _ours(caplog) == []
