"""A second `fit()` of one Trainer at MLflow, with fp8_lint beside fp8_stats: every param and
loss of both fits reaches MLflow, read back with MLflow's own client. Composer's MLflow logger
buffers MLflow's asynchronous queue (`logging_buffer_seconds`, default 10) and MLflow merges
what is queued into one batch, which it refuses whole when a param key occurs in it twice, even
with the same value ('Duplicate parameter keys have been submitted'): fp8_lint sent
`fp8_lint/findings` again at each FIT_START, and a second fit within the buffer lost the run's
every param and metric (QA session 23: 0 params, 0 loss points)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from foundry_fp8.composer.lint import FP8Lint
from foundry_fp8.composer.stats import FP8Stats

pytest.importorskip("mlflow")
pytestmark = pytest.mark.usefixtures("one_mlflow_thread")


def test_a_second_fit_with_fp8_lint_keeps_every_param_and_loss_at_mlflow(tmp_path):
    from composer import Trainer
    from composer.loggers import MLFlowLogger
    from composer.models import ComposerClassifier
    from mlflow.tracking import MlflowClient
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))
    model = ComposerClassifier(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), num_classes=2)
    # both fits inside one buffer of MLflow's queue, however slow the machine
    logger = MLFlowLogger(tracking_uri=f"file://{tmp_path}/mlruns", experiment_name="fp8",
                          run_name="twice", logging_buffer_seconds=600)
    trainer = Trainer(model=model, train_dataloader=DataLoader(data, batch_size=8),
                      max_duration="2ba", loggers=[logger], device="cpu", progress_bar=False,
                      log_to_console=False,
                      callbacks=[FP8Lint({}), FP8Stats(interval=1, image_interval=None)])
    trainer.fit()
    trainer.fit(duration="2ba")
    trainer.close()

    client = MlflowClient(tracking_uri=f"file://{tmp_path}/mlruns")
    run = client.get_run(logger._run_id)
    losses = client.get_metric_history(run.info.run_id, "loss/train/total")
    assert [m.step for m in losses] == [0, 1, 2, 3]
    assert run.data.params["fp8_lint/findings"] == "0"
    assert {"fp8/layers", "fp8/stats_summary", "fp8/stats_summary.ba4"} <= run.data.params.keys()


def test_a_second_fit_with_te_swap_keeps_every_loss_at_mlflow(tmp_path):
    """Composer itself logs `enabled_algorithms/TESwap` at each fit's start: te_swap sends
    MLflow's queue at fit end, so the second fit's copy is not in the first's batch (before:
    0 params, 0 loss points)."""
    from composer import Trainer
    from composer.loggers import MLFlowLogger
    from composer.models import ComposerClassifier
    from mlflow.tracking import MlflowClient
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.te_swap import TESwap
    from tests.test_guard_flops import TOKENS, VOCAB, TiedLM

    torch.manual_seed(0)
    data = TensorDataset(*torch.randint(0, VOCAB, (2, 8 * TOKENS)))  # a batch: TOKENS tokens
    model = ComposerClassifier(TiedLM(), num_classes=VOCAB)
    logger = MLFlowLogger(tracking_uri=f"file://{tmp_path}/mlruns", experiment_name="fp8",
                          run_name="twice", logging_buffer_seconds=600)
    trainer = Trainer(model=model, train_dataloader=DataLoader(data, batch_size=TOKENS),
                      max_duration="2ba", loggers=[logger], device="cpu", progress_bar=False,
                      log_to_console=False, algorithms=[TESwap(backend="emulate")])
    trainer.fit()
    trainer.fit(duration="2ba")
    trainer.close()

    client = MlflowClient(tracking_uri=f"file://{tmp_path}/mlruns")
    run = client.get_run(logger._run_id)
    losses = client.get_metric_history(run.info.run_id, "loss/train/total")
    assert [m.step for m in losses] == [0, 1, 2, 3]
    assert run.data.params["enabled_algorithms/TESwap"] == "True"
