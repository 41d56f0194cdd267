"""A second `fit()` of one Trainer at MLflow: every param and loss of both fits reaches MLflow,
read back with MLflow's own client. Composer's MLflow logger buffers MLflow's asynchronous queue
(`logging_buffer_seconds`, default 10) and MLflow merges what is queued into one batch, which it
refuses whole when a param key occurs in it twice, even with the same value ('Duplicate
parameter keys have been submitted'): fp8_lint sent `fp8_lint/findings` again at each
FIT_START, and Composer sends `enabled_algorithms/<algorithm>` at each fit's start, so a second
fit within the buffer lost the run's every param and metric (QA session 23: 0 params, 0 loss
points)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from foundry_fp8.composer.lint import FP8Lint
from foundry_fp8.composer.stats import FP8Stats

pytest.importorskip("mlflow")
pytestmark = pytest.mark.usefixtures("one_mlflow_thread")


def _fit_twice(folder: Path, model: nn.Module, data: Any, batch_size: int,
               **trainer: Any) -> tuple[Any, list[int]]:
    """Fit 2 batches, then 2 more in the same Trainer, both inside one buffer of MLflow's queue
    however slow the machine; the MLflow run and the steps of its loss, as MLflow holds them."""
    from composer import Trainer
    from composer.loggers import MLFlowLogger
    from composer.models import ComposerClassifier
    from mlflow.tracking import MlflowClient
    from torch.utils.data import DataLoader

    logger = MLFlowLogger(tracking_uri=f"file://{folder}/mlruns", experiment_name="fp8",
                          run_name="twice", logging_buffer_seconds=600)
    fitted = Trainer(model=ComposerClassifier(model, num_classes=model.classes),
                     train_dataloader=DataLoader(data, batch_size=batch_size),
                     max_duration="2ba", loggers=[logger], device="cpu", progress_bar=False,
                     log_to_console=False, **trainer)
    fitted.fit()
    fitted.fit(duration="2ba")
    fitted.close()
    client = MlflowClient(tracking_uri=f"file://{folder}/mlruns")
    run = client.get_run(logger._run_id)
    return run, [m.step for m in client.get_metric_history(run.info.run_id, "loss/train/total")]


class _Net(nn.Sequential):
    classes = 2

    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 8), nn.Linear(8, self.classes))


def test_a_second_fit_with_fp8_lint_keeps_every_param_and_loss_at_mlflow(tmp_path):
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))
    run, losses = _fit_twice(tmp_path, _Net(), data, 8, callbacks=[
        FP8Lint({}), FP8Stats(interval=1, image_interval=None)])
    assert losses == [0, 1, 2, 3]
    assert run.data.params["fp8_lint/findings"] == "0"
    assert {"fp8/layers", "fp8/stats_summary", "fp8/stats_summary.ba4"} <= run.data.params.keys()


def test_a_second_fit_with_te_swap_keeps_every_loss_at_mlflow(tmp_path):
    """Composer itself logs `enabled_algorithms/TESwap` at each fit's start: te_swap sends
    MLflow's queue at fit end, so the second fit's copy is not in the first's batch (before:
    0 params, 0 loss points)."""
    from torch.utils.data import TensorDataset

    from foundry_fp8.composer.te_swap import TESwap
    from tests.test_guard_flops import TOKENS, VOCAB, TiedLM

    class Tied(TiedLM):
        classes = VOCAB

    torch.manual_seed(0)
    data = TensorDataset(*torch.randint(0, VOCAB, (2, 8 * TOKENS)))  # a batch: TOKENS tokens
    run, losses = _fit_twice(tmp_path, Tied(), data, TOKENS,
                             algorithms=[TESwap(backend="emulate")])
    assert losses == [0, 1, 2, 3]
    assert run.data.params["enabled_algorithms/TESwap"] == "True"


def test_one_fp8_lint_given_to_a_second_trainer_logs_its_findings_there_too():
    """Review V s23: what fp8_lint sent is per Trainer (cleared at INIT); a second Trainer's
    loggers got no `fp8_lint/findings` once a first had them."""
    from composer import Trainer
    from composer.loggers import InMemoryLogger
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(8, 8), torch.randint(0, 2, (8,)))
    lint = FP8Lint({})
    for _ in range(2):
        logger = InMemoryLogger()
        Trainer(model=ComposerClassifier(_Net(), num_classes=2), loggers=[logger],
                train_dataloader=DataLoader(data, batch_size=8), max_duration="1ba",
                callbacks=[lint], device="cpu", progress_bar=False).fit()
        assert logger.hyperparameters["fp8_lint/findings"] == 0
