"""A run whose fp8_stats schedule meets no logging step says so, whatever unit `max_duration`
is in. FIT_START judges durations in batches (or epochs of a sized loader); one in samples or
tokens (LLM-Foundry's `max_duration: ...tok`) logged no series, no summary and said nothing: a
smoke test with `start: 10` looked like a run fp8_stats had nothing to say about. Now FIT_END
says it, once; a run told at FIT_START, or one that logged, hears nothing more."""

from __future__ import annotations

import logging

import pytest
import torch
from composer import Trainer
from composer.loggers import InMemoryLogger
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.stats import FP8Stats

BATCH = 8


def _said(options: dict, duration: str, caplog) -> tuple[list[str], InMemoryLogger]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(6 * BATCH, 8), torch.randint(0, 2, (6 * BATCH,)))
    model = ComposerClassifier(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), num_classes=2)
    memory = InMemoryLogger()
    with caplog.at_level(logging.WARNING):
        Trainer(model=model, train_dataloader=DataLoader(data, batch_size=BATCH),
                max_duration=duration, callbacks=[FP8Stats(image_interval=None, **options)],
                loggers=[memory], device="cpu", progress_bar=False).fit()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fp8_stats: ")
            and ("no logging step" in r.getMessage() or "no FP8 statistics" in r.getMessage())]
    return said, memory


def test_a_run_in_samples_that_never_logs_says_so_at_its_end(caplog):
    said, memory = _said({"interval": 2, "start": 10}, f"{5 * BATCH}sp", caplog)
    assert not any(key.startswith("fp8") for key in memory.data)  # batches 0-4: none logs
    assert said == ["fp8_stats: this run logged no FP8 statistics (it ended after batch 4; "
                    "interval 2, start 10, end None): lower callbacks.fp8_stats.interval or "
                    "start to see FP8 statistics"]


@pytest.mark.parametrize(("options", "duration"), [
    ({"interval": 2, "start": 10}, "5ba"),  # said at FIT_START, not again
    ({"interval": 2, "start": 2}, f"{5 * BATCH}sp"),  # logs at batches 2 and 4
])
def test_a_run_told_at_its_start_or_that_logged_hears_nothing_at_its_end(options, duration,
                                                                         caplog):
    said, memory = _said(options, duration, caplog)
    logged = any(key.startswith("fp8") for key in memory.data)
    assert said == ([] if logged else [said[0]])
    assert all(not line.startswith("fp8_stats: this run logged no") for line in said)
