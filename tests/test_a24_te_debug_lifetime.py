"""fp8_stats' TE debug session leaves nothing behind in a process that trains again (a notebook,
a sweep): on the real nvdlfw-inspect, with TE's feature folder stood in by an empty one (TE is
not installed here; its features are not what these tests are about)."""

from __future__ import annotations

import logging
import os
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
from foundry_fp8.te.debug import INSPECT_LOGGERS, TEDebugSession, log_fp8_tensor_stats_config

debug_api = pytest.importorskip("nvdlfw_inspect.api")

CONFIG = log_fp8_tensor_stats_config(".*", ["activation"], 1)


#: TE's debug namespace and the one feature fp8_stats configures, as nvdlfw-inspect registers
#: them (TE: transformer_engine/debug/features/api.py, log_fp8_tensor_stats.py), doing nothing
STAND_IN = """
from nvdlfw_inspect.base import BaseNamespaceAPI
from nvdlfw_inspect.registry import Registry


@Registry.register_namespace_api(namespace="transformer_engine")
class TransformerEngineAPI(BaseNamespaceAPI):
    def input_assertions_hook(self, api_name, **kwargs):
        pass

    def routing_condition(self, api_name, config, layer_name, feature_obj, **kwargs):
        return True, None

    def output_assertions_hook(self, api_name, ret, **kwargs):
        pass

    def is_multiple_feature_invocation_allowed(self, api_name):
        return False


@Registry.register_feature(namespace="transformer_engine")
class LogFp8TensorStats:
    pass
"""


@pytest.fixture
def te_features(fake_te, monkeypatch, tmp_path):
    """The stand-in TE, whose `transformer_engine.debug.features` is an empty folder."""
    fake_te()
    folder = tmp_path / "features"
    folder.mkdir()
    (folder / "stand_in.py").write_text(STAND_IN)
    debug = types.ModuleType("transformer_engine.debug")
    features = types.ModuleType("transformer_engine.debug.features")
    features.__file__ = str(folder / "__init__.py")
    state = types.ModuleType("transformer_engine.debug.pytorch.debug_state")
    state.TEDebugState = type("TEDebugState", (), {"debug_enabled": None})  # type: ignore[attr-defined]
    debug.features = features  # type: ignore[attr-defined]
    for module in (debug, features, types.ModuleType("transformer_engine.debug.pytorch"), state):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(sys.modules["transformer_engine"], "debug", debug, raising=False)
    debug_api.end_debug()
    yield
    debug_api.end_debug()
    TEDebugSession._open = None


def _open_files_under(folder: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found


def _handlers() -> int:
    return sum(len(logging.getLogger(name).handlers) for name in INSPECT_LOGGERS)


def test_closed_sessions_leave_no_log_file_open(te_features, tmp_path):
    """nvdlfw-inspect opens its log at each `initialize` and `end_debug` leaves it open: 3 runs
    left 3 open files and 6 handlers, and the 4th run's messages went into all 3 old logs."""
    before = _handlers()
    for run in range(3):
        session = TEDebugSession(CONFIG, tmp_path / f"run{run}", lambda name, value, step: None)
        session.start()
        assert _open_files_under(tmp_path / f"run{run}")  # its log, while it runs
        session.close()
        assert debug_api.DEBUG_MANAGER is None
    assert _handlers() == before
    assert _open_files_under(tmp_path) == []


class _Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("simulated failure")


def test_a_fit_that_raised_leaves_te_debug_free_for_the_next_run(te_features, tmp_path):
    """LLM-Foundry's `train()` leaves the Trainer of a fit that raised unclosed, and no FIT_END
    ended its TE debug session: building the next run's fp8_stats raised nvdlfw-inspect's
    "Already initialized" (the notebook had to be restarted). The first Trainer's late close
    then leaves the new run's session alone."""
    data = TensorDataset(torch.randn(8, 8), torch.randint(0, 2, (8,)))
    first = FP8Stats(interval=1, te_debug="delayed", te_debug_folder=str(tmp_path / "a"))
    trainer = Trainer(model=ComposerClassifier(_Failing(), num_classes=2),
                      train_dataloader=DataLoader(data, batch_size=4), max_duration="2ba",
                      callbacks=[first], device="cpu", loggers=[], progress_bar=False)
    with pytest.raises(RuntimeError, match="simulated failure"):
        trainer.fit()
    second = FP8Stats(interval=1, te_debug="delayed", te_debug_folder=str(tmp_path / "b"))
    started = debug_api.DEBUG_MANAGER
    assert started is not None
    trainer.close()
    assert debug_api.DEBUG_MANAGER is started  # the second run's, still on
    second.close(None, None)  # Composer's Engine._close: (state, logger)
    assert debug_api.DEBUG_MANAGER is None
    assert _open_files_under(tmp_path) == []
