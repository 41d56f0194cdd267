"""`progress_bar: true` (Composer's ProgressBarLogger) is a console too: it yaml-dumps every
hyperparameter at its FIT_START, after the callbacks' (composer/loggers/progress_bar_logger.py
`fit_start`, `_log_hparams_to_console`), so fp8_stats' layer order (`fp8/layers`) printed one
line per watched layer there (an MPT-1B: 96), as the ConsoleLogger's did before
tests/test_f2_layer_order_hparam.py; hparams.json still holds it."""

from __future__ import annotations

import json

import torch
from composer import Trainer
from composer.loggers import ProgressBarLogger
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.health.keys import LAYER_ORDER


def test_the_progress_bar_prints_no_layer_order_and_hparams_json_keeps_it(tmp_path):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 8), torch.randint(0, 2, (8,)))
    model = ComposerClassifier(nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)),
                                             nn.Linear(8, 2)), num_classes=2)
    console = tmp_path / "console.txt"
    stream = console.open("w")  # a file: the bar asks its stream for a file descriptor
    trainer = Trainer(model=model, train_dataloader=DataLoader(data, batch_size=8),
                      max_duration="1ba", device="cpu", progress_bar=False, log_to_console=False,
                      callbacks=[FP8Stats(interval=1, image_interval=None)],
                      loggers=[ProgressBarLogger(stream=stream),
                               JSONLLogger(path=str(tmp_path / "metrics.jsonl"))])
    trainer.fit()
    trainer.close()
    stream.close()
    printed = console.read_text()
    assert "Config:" in printed and "rank_zero_seed" in printed  # its dump ran
    assert LAYER_ORDER not in printed and "module.0" not in printed
    hparams = json.loads((tmp_path / "hparams.json").read_text())
    assert hparams[LAYER_ORDER]["layers"] == [f"module.{i}" for i in range(4)]
