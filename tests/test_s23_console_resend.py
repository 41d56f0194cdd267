"""Our own error while giving the console again what an evaluation kept off it
(`destinations.ConsoleResend`) costs only those console lines: said once, naming the callback,
and training goes on (QA s23: fp8_stats called it unguarded, so the error ended the run at the
first BATCH_START after a logging step). `strict: true` raises it. The error is injected into
the function ConsoleResend asks whether the console printed since a step."""

from __future__ import annotations

import logging

import pytest
import torch
from composer import Trainer
from composer.loggers import ConsoleLogger, InMemoryLogger
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer import destinations
from foundry_fp8.composer.destinations import ConsoleResend
from foundry_fp8.composer.stats import FP8Stats

BATCH, FEATURES, BATCHES, INTERVAL = 4, 8, 6, 2
SAID = "internal error resending its series to the console"


def _broken(console: ConsoleLogger, step: int) -> bool:
    raise RuntimeError("injected fault")


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if SAID in r.getMessage()]


def test_fp8_stats_trains_on_when_its_console_resend_fails(monkeypatch, caplog):
    monkeypatch.setattr(destinations, "_printed_since", _broken)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(BATCHES * BATCH, FEATURES),
                         torch.randint(0, 2, (BATCHES * BATCH,)))
    memory = InMemoryLogger()
    trainer = Trainer(model=ComposerClassifier(nn.Sequential(nn.Linear(FEATURES, 2)),
                                               num_classes=2),
                      train_dataloader=DataLoader(data, batch_size=BATCH),
                      max_duration=f"{BATCHES}ba", device="cpu", progress_bar=False,
                      log_to_console=True, console_log_interval="5ba", loggers=[memory],
                      callbacks=[FP8Stats(interval=INTERVAL, image_interval=None)])
    with caplog.at_level(logging.ERROR):
        trainer.fit()  # raised RuntimeError at batch 1's start on the old code

    assert int(trainer.state.timestamp.batch) == BATCHES
    [message] = _said(caplog)  # once, though every later batch start resends
    assert message.startswith("fp8_stats: ") and "training goes on" in message
    logged = [int(timestamp.batch) for timestamp, _ in memory.data["fp8/flagged_layers"]]
    assert logged == list(range(0, BATCHES, INTERVAL))  # fp8_stats itself went on logging


def _pending(resend: ConsoleResend) -> None:
    """A logging step's series noted as given to a console that has printed nothing since."""
    resend.sent(ConsoleLogger(), {"fp8/flagged_layers": 0.0}, 3)


def test_the_error_is_raised_under_strict(monkeypatch):
    resend = ConsoleResend()
    _pending(resend)
    monkeypatch.setattr(destinations, "_printed_since", _broken)
    with pytest.raises(RuntimeError, match="injected fault"):
        resend.resend("fp8_stats", strict=True)


def test_the_error_is_said_once_per_callback_and_fit_end_goes_on(monkeypatch, caplog):
    first, second = ConsoleResend(), ConsoleResend()
    _pending(first)
    _pending(second)
    monkeypatch.setattr(destinations, "_printed_since", _broken)
    with caplog.at_level(logging.ERROR):
        first.resend("fp8_stats")
        first.resend("fp8_stats")
        first.fit_end("fp8_stats")
        second.fit_end("fp8_guard")
    assert [m.partition(":")[0] for m in _said(caplog)] == ["fp8_stats", "fp8_guard"]
