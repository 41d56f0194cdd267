"""FP8Monitor in a plain loop that evaluates (`model.eval()` + `torch.no_grad()`) on a logging
step before it trains: the evaluation's forward is not the step's training statistics.

fp8_stats arms its hooks from BATCH_START to AFTER_TRAIN_BATCH only, so Composer's evaluation
never reaches them; a plain loop has one window, `start_step` to `finish_step`, and an
evaluation at the top of a step (`if step % eval_every == 0: evaluate()`) falls inside it. The
first sighting of a tensor in the step wins (`_observe`), so the evaluation batch became the
step's activation statistics, and the first forward decides the layer's cast mode
(`_forward`): an evaluation outside `fp8_autocast` made an FP8 layer's row a what-if.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from foundry_fp8 import FP8Recipe, SwapConfig, convert_to_fp8, fp8_autocast
from foundry_fp8.monitor import FP8Monitor
from foundry_fp8.options import MonitorConfig, Schedule


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _evaluate(model: nn.Module) -> None:
    """An evaluation batch 1000x the training scale, so its amax cannot pass for training's."""
    model.eval()
    with torch.no_grad():
        model(torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * 1000)
    model.train()


@pytest.mark.parametrize("fp8", [False, True])
def test_an_evaluation_at_the_top_of_a_logging_step_is_not_its_statistics(fp8):
    torch.manual_seed(0)
    model = Net()
    if fp8:
        convert_to_fp8(model, SwapConfig(backend="emulate"))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = FP8Monitor(model, MonitorConfig(layers=r"^layers\.0\.up$", recipe="delayed"),
                         schedule=Schedule(interval="1ba"))
    layer = model.layers[0].up
    monitor.start_step(0)
    _evaluate(model)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    with fp8_autocast(enabled=fp8, recipe=FP8Recipe()):
        # the scale the training forward casts its input with (delayed: the one in force)
        scale = layer.fp8_meta["scaling_fwd"].scale[0].item() if fp8 else None
        loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    metrics = monitor.finish_step()
    assert metrics["fp8_amax/activation/layers.0.up"] == x.abs().max().item()
    if fp8:  # the layer's own cast, not a what-if
        assert (("layers.0.up", "activation") not in monitor.whatif_rows
                and metrics["fp8_scale/activation/layers.0.up"] == scale)
