"""Composer's EMA averages and swaps a model's buffers; the emulated FP8 scales and amax
histories (TE keeps its own outside buffers too) must not take part, or the run casts with an
average of scales and the checkpoint's fp8_state holds it. Checked against TE's update written
out by hand (`tests/test_emulate_te.py`, `tests/test_emulate_dtype.py`)."""

from __future__ import annotations

import torch
from composer import Trainer
from composer.algorithms import EMA
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.fp8_meta import read_fp8_meta
from tests.test_emulate_dtype import HISTORY, te_history
from tests.test_emulate_te import E4M3, te_amax, te_scale

BATCHES = 3  # fewer than HISTORY: no amax has left the history yet


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


def test_ema_leaves_the_fp8_state_alone(tmp_path):
    """EMA swaps its averages into the model for each checkpoint (here after the last batch,
    so they stay there) and for eval."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * BATCHES, 16) * 3, torch.randint(0, 4, (8 * BATCHES,)))
    net = _Net()
    inputs: list[float] = []
    trainer = Trainer(
        model=ComposerClassifier(net, num_classes=4),
        train_dataloader=DataLoader(data, batch_size=8), max_duration=f"{BATCHES}ba",
        algorithms=[TESwap(backend="emulate", fp8_recipe={"amax_history_len": HISTORY}),
                    EMA(half_life="1ba")],
        eval_dataloader=DataLoader(data, batch_size=8), eval_interval="1ba",
        save_folder=str(tmp_path), save_interval=f"{BATCHES}ba",
        device="cpu", progress_bar=False, loggers=[])
    layer = net.blocks[0]
    layer.register_forward_pre_hook(
        lambda module, args: inputs.append(te_amax(args[0])) if module.training else None)
    trainer.fit()
    assert len(inputs) == BATCHES
    state = read_fp8_meta(layer)
    assert state["fwd_amax_history"][:, 0].tolist() == te_history(
        [float(torch.tensor(a, dtype=torch.float32)) for a in inputs])
    assert state["fwd_scale"][0].item() == te_scale(E4M3, max(inputs))
    trainer.close()
