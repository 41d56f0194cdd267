"""fp8_stats and fp8_guard on Composer's console when an evaluation runs between a logging step and
the console's next print: Composer's ConsoleLogger drops at EVAL_START what it has not printed
yet (composer/loggers/console_logger.py, `eval_start`), so the values of a logging step never
reached the console. Reference: the watched layer's input captured by the test's own hook on the
training forwards, reduced with plain torch."""

from __future__ import annotations

import re

import torch
from composer import Trainer
from composer.core import Callback
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.health import layer_key

BATCH, FEATURES = 4, 16
LOGGED, EVAL, PRINTED = 3, 4, 5  # fp8_stats logs at 3, evaluates at 4, the console prints at 5
NEXT_PRINT = 2 * PRINTED  # the console's next print: no fp8_stats step since LOGGED (its `end`)


class _InputAmax(Callback):
    """max |x| of layer 0's input per training batch (grad enabled: not the evaluation's)."""

    def __init__(self) -> None:
        self.by_batch: dict[int, float] = {}
        self._batch = 0

    def fit_start(self, state, logger) -> None:
        def forward(module, args) -> None:
            if torch.is_grad_enabled():
                amax = args[0].detach().abs().max().item()
                self.by_batch[self._batch] = max(self.by_batch.get(self._batch, 0.0), amax)

        state.model.module[0].register_forward_pre_hook(forward)

    def batch_start(self, state, logger) -> None:
        self._batch = int(state.timestamp.batch)


def _printed(text: str, batch: int) -> dict[str, str]:
    """The `Train <key>: <value>` lines of the console's print at batch count `batch`."""
    block = re.search(rf"^\[batch={batch}/\d+\]:\n((?:\t .*\n)*)", text, re.MULTILINE)
    assert block is not None, text
    return dict(re.findall(r"^\t Train (\S+): (\S+)$", block.group(1), re.MULTILINE))


def test_a_logging_step_before_an_evaluation_reaches_the_console(capfd):
    torch.manual_seed(0)
    x = torch.randn(10 * BATCH, FEATURES)
    x[LOGGED * BATCH:(LOGGED + 1) * BATCH] *= 3.0  # the logged batch's amax stands out
    train = TensorDataset(x, torch.randint(0, 2, (10 * BATCH,)))
    # evaluation inputs far larger than any training one: counted, they would be the amax
    held_out = TensorDataset(100.0 * torch.randn(2 * BATCH, FEATURES),
                             torch.randint(0, 2, (2 * BATCH,)))
    net = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 2))
    captured = _InputAmax()
    Trainer(model=ComposerClassifier(net, num_classes=2),
            train_dataloader=DataLoader(train, batch_size=BATCH),
            eval_dataloader=DataLoader(held_out, batch_size=BATCH),
            eval_interval=f"{EVAL}ba", max_duration="10ba", device="cpu", progress_bar=False,
            log_to_console=True, console_log_interval=f"{PRINTED}ba", console_stream="stdout",
            device_train_microbatch_size=BATCH // 2,
            callbacks=[FP8Stats(interval=LOGGED, end=LOGGED + 1, image_interval=None,
                                console_layers=True),
                       FP8Guard(), captured]).fit()

    out = capfd.readouterr().out
    printed = _printed(out, PRINTED)
    amax = layer_key("amax", "activation", "module.0")
    assert printed[amax] == f"{captured.by_batch[LOGGED]:.4f}"  # the training batch's alone
    assert "fp8/flagged_layers" in printed
    assert printed["fp8/guard/fallback_layers"] == "0.0000"
    # given once: the print after it holds the console's own series and none of the step's
    later = _printed(out, NEXT_PRINT)
    assert "loss/train/total" in later, later
    assert [key for key in later if key.startswith("fp8")] == [], later
