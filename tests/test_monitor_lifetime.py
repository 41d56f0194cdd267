"""The model of a finished run is freed: fp8_stats' hooks, which a run's last autograd graph
keeps alive from C++ (where the garbage collector cannot see them), hold the monitor weakly."""

from __future__ import annotations

import atexit
import gc
import weakref

import torch
from composer import Trainer
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])  # FP8 (te_swap)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def _fit_and_drop() -> weakref.ref[nn.Module]:
    """A fit whose last batch is a logging step (interval 1), closed, then dropped. (Imports
    stay at module level: a module imported here for the first time can keep a frame of its
    import, and through it this function's locals.)"""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 16), torch.randint(0, 4, (16,)))
    model = ComposerClassifier(_Net(), num_classes=4)
    trainer = Trainer(model=model, train_dataloader=DataLoader(data, batch_size=8),
                      max_duration="2ba", algorithms=[TESwap(backend="emulate")],
                      callbacks=[FP8Stats(interval=1)], device="cpu", progress_bar=False,
                      loggers=[])
    trainer.fit()
    trainer.close()
    # Composer's atexit hook holds every Engine's State until the process exits; closed, it
    # has nothing left to do
    atexit.unregister(trainer.engine._close)
    return weakref.ref(model)


def test_the_model_is_freed_after_a_run_whose_last_batch_logged():
    model = _fit_and_drop()
    gc.collect()
    assert model() is None, "the finished run's model (and its State) is still alive"
