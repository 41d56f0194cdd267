"""`JSONLLogger.log_metrics(metrics)` called without a step (code calling the destination
directly; Composer's Logger always passes one) wrote step -1, which made `read_jsonl` refuse the
whole file: the report could not read the run. A missing step is now the current batch, as
Composer's own Logger.log_metrics fills it in; a step the reader would refuse is not written."""

from __future__ import annotations

import logging

import torch
from composer import Callback, Trainer
from composer.core import State
from composer.loggers import Logger
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.jsonl import read_jsonl


class _Direct(Callback):
    """At each batch end: one record through Composer's Logger without a step (the reference:
    it fills in the step), one straight to the destination without a step, one with step -1."""

    def __init__(self, destination: JSONLLogger):
        self.destination = destination

    def batch_end(self, state: State, logger: Logger) -> None:
        logger.log_metrics({"via_logger": 1.0})
        self.destination.log_metrics({"direct": 2.0})
        self.destination.log_metrics({"negative": 3.0}, step=-1)


def test_a_record_without_a_step_is_at_composers_step_and_the_file_stays_readable(tmp_path,
                                                                                   caplog):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(12, 8), torch.randint(0, 2, (12,)))
    model = ComposerClassifier(nn.Linear(8, 2), num_classes=2)
    destination = JSONLLogger(path=str(tmp_path / "metrics.jsonl"))
    with caplog.at_level(logging.WARNING, "foundry_fp8.composer.jsonl_logger"):
        Trainer(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                train_dataloader=DataLoader(data, batch_size=4), max_duration="3ba",
                loggers=[destination], callbacks=[_Direct(destination)], run_name="r",
                progress_bar=False, log_to_console=False).fit()
    records = list(read_jsonl(tmp_path / "metrics.jsonl"))  # raised JsonlError on step -1
    via_logger = [step for step, metrics in records if "via_logger" in metrics]
    direct = [step for step, metrics in records if "direct" in metrics]
    assert via_logger == [1, 2, 3]
    assert direct == via_logger
    assert not any("negative" in metrics for _, metrics in records)
    [said] = [r.getMessage() for r in caplog.records if "step -1" in r.getMessage()]
    assert said.startswith(f"jsonl logger: a record at step -1 not written to {tmp_path}")
