"""A bug of ours in work fp8_stats does again at every logging step or checkpoint (its heatmaps,
its state read for a save) is said once, with its traceback, not once per step: a 100k-batch
run with `interval: 100` logged a thousand tracebacks for one bug. The series still reach the
`jsonl` logger at every logging step, and the checkpoints still save."""

from __future__ import annotations

import logging

import torch
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer import stats as stats_module
from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.monitor import FP8Monitor
from tests.test_guard_flops import TOKENS, VOCAB, TiedLM

BATCHES = 4


def _bug(*args, **kwargs):
    raise RuntimeError("injected bug")


def test_a_bug_recurring_at_each_step_is_said_once_and_the_series_go_on(tmp_path, monkeypatch,
                                                                        caplog):
    from composer import Trainer
    from composer.models import ComposerClassifier

    monkeypatch.setattr(stats_module, "render_heatmap", _bug)  # every image step
    monkeypatch.setattr(FP8Monitor, "state_dict", _bug)  # every checkpoint
    torch.manual_seed(0)
    tokens, labels = torch.randint(0, VOCAB, (2, TOKENS))
    data = TensorDataset(tokens.repeat(BATCHES), labels.repeat(BATCHES))
    model = ComposerClassifier(TiedLM(), num_classes=VOCAB)
    with caplog.at_level(logging.DEBUG, logger="foundry_fp8"):
        trainer = Trainer(
            model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0), seed=17,
            run_name="run", train_dataloader=DataLoader(data, batch_size=TOKENS),
            max_duration=f"{BATCHES}ba", algorithms=[TESwap(backend="emulate")],
            callbacks=[FP8Stats(interval=1, image_interval=1)],
            loggers=[JSONLLogger(path=str(tmp_path / "metrics.jsonl"))], device="cpu",
            progress_bar=False, save_folder=str(tmp_path / "checkpoints"), save_interval="2ba")
        trainer.fit()
        trainer.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage().split(" (")[0] for r in errors] == [
        "fp8_stats: logging the images and table failed on rank 0",
        "fp8_stats: reading its state to save failed on rank 0"]
    assert all(r.exc_info and "said once" in r.getMessage() for r in errors)
    again = [r for r in caplog.records if r.levelno == logging.DEBUG and "failed again" in
             r.getMessage()]
    assert len(again) >= BATCHES - 1 + 1  # later image steps, the second checkpoint
    steps = sorted(step for step, metrics in read_jsonl(tmp_path / "metrics.jsonl")
                   if "fp8/flagged_layers" in metrics)
    assert steps == list(range(BATCHES))
    assert len(list((tmp_path / "checkpoints").glob("ep0-ba*-rank0.pt"))) == 2

