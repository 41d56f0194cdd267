"""fp8_stats' `te_debug` and TE's debug iteration: evaluation forwards stay out of TE's statistics,
and TE's iteration is Composer's batch count after a resume.

TE's modules decide at every forward whether to feed their statistics buffers from
`TEDebugState.debug_enabled` and `TEDebugState.get_iteration()` (= nvdlfw-inspect's
`DEBUG_MANAGER._trainer_iteration_count`; TE main d0067d0, debug/pytorch/debug_state.py:66-70 and
pytorch/module/base.py `is_debug_iter`), training or not. TE is not installed here: the stand-in
`TEDebugState` below reads the real nvdlfw-inspect's counter as TE does, and the model records what
a TE module would see at each forward. Reference: Composer's own batch count and `model.training`.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from composer import Trainer
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.te.debug import TEDebugSession

debug_api = pytest.importorskip("nvdlfw_inspect.api")

BATCH, FEATURES = 4, 8


class _TEDebugState:
    """TE's class attribute and iteration, as its modules read them."""

    debug_enabled: bool | None = True

    @classmethod
    def get_iteration(cls) -> int:
        return debug_api.DEBUG_MANAGER._trainer_iteration_count


class _Seen(nn.Module):
    """Records (training, TE debug on, TE iteration) at each forward, as a TE module would ask."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, 2)
        self.seen: list[tuple[bool, bool, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.training, bool(_TEDebugState.debug_enabled),
                          _TEDebugState.get_iteration()))
        return self.linear(x)


@pytest.fixture
def te_debug_state(monkeypatch, tmp_path):
    module = types.ModuleType("transformer_engine.debug.pytorch.debug_state")
    module.TEDebugState = _TEDebugState  # type: ignore[attr-defined]
    for name in ("transformer_engine", "transformer_engine.debug",
                 "transformer_engine.debug.pytorch"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(_TEDebugState, "debug_enabled", True)
    yield
    debug_api.end_debug()


def _fit(tmp_path: Path, **kwargs) -> tuple[_Seen, Trainer]:
    """A fit whose fp8_stats has a TE debug session on the real nvdlfw-inspect (no features)."""
    debug_api.end_debug()
    debug_api.initialize(config_file="", log_dir=str(tmp_path / "te"))
    stats = FP8Stats(interval=2, image_interval=None)
    stats.te_debug = TEDebugSession({}, tmp_path / "te", lambda name, value, step: None)
    net = _Seen()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * BATCH, FEATURES), torch.randint(0, 2, (8 * BATCH,)))
    trainer = Trainer(model=ComposerClassifier(net, num_classes=2),
                      train_dataloader=DataLoader(data, batch_size=BATCH),
                      eval_dataloader=DataLoader(data, batch_size=BATCH), eval_interval="2ba",
                      device="cpu", progress_bar=False, callbacks=[stats],
                      save_folder=str(tmp_path / "ckpt"), save_interval="2ba", **kwargs)
    trainer.fit()
    return net, trainer


def test_evaluation_forwards_do_not_feed_te_debug_statistics(te_debug_state, tmp_path):
    net, _ = _fit(tmp_path, max_duration="4ba")
    evals = [s for s in net.seen if not s[0]]
    train = [s for s in net.seen if s[0]]
    assert evals, "no evaluation ran"
    # an evaluation after batch 2 runs at TE iteration 2, a logging step: TE debug must be off
    assert {(debug, it) for _, debug, it in evals} == {(False, 2), (False, 4)}
    assert [(debug, it) for _, debug, it in train] == [(True, 0), (True, 1), (True, 2), (True, 3)]


def test_te_debug_iteration_is_the_batch_count_after_a_resume(te_debug_state, tmp_path):
    _fit(tmp_path, max_duration="2ba")
    net, _ = _fit(tmp_path, max_duration="4ba",
                  load_path=str(tmp_path / "ckpt" / "ep0-ba2-rank0.pt"))
    # TE logs at iterations with iteration % freq == 0 from start_step: batch 2 must be TE's 2
    assert [it for training, _, it in net.seen if training] == [2, 3]
