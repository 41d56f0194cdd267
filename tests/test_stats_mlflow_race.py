"""fp8_stats warns at FIT_START where Composer's MLflow logger writes asynchronously to a local
file store with more than one writer thread: MLflow's writer threads race creating a new metric's
folder (`[Errno 17] File exists`) and drop the whole batch, Composer's loss included
(foundry_fp8/mlflow_facts.py). A real Trainer with a real MLFlowLogger to a tmp file store."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch import nn

from foundry_fp8.composer.stats import FP8Stats, mlflow_races

pytest.importorskip("mlflow")

ENV = "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE"  # MLflow's own name (environment_variables.py)


def _fit(tmp_path, caplog, synchronous: bool = False, fits: int = 1) -> list[str]:
    """fp8_stats' warnings about MLflow over `fits` fits of one Trainer."""
    from composer import Trainer
    from composer.loggers import MLFlowLogger
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,)))
    model = ComposerClassifier(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), num_classes=2)
    logger = MLFlowLogger(tracking_uri=f"file://{tmp_path}/mlruns", experiment_name="fp8",
                          synchronous=synchronous)
    trainer = Trainer(model=model, train_dataloader=DataLoader(data, batch_size=8),
                      max_duration="2ba", callbacks=[FP8Stats(interval=1, image_interval=None)],
                      loggers=[logger], device="cpu", progress_bar=False, log_to_console=False)
    with caplog.at_level(logging.WARNING, logger="foundry_fp8"):
        trainer.fit()
        for _ in range(fits - 1):
            trainer.fit(duration="1ba")
    trainer.close()
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("foundry_fp8") and "MLflow" in r.getMessage()]


def test_an_asynchronous_file_store_logger_is_warned_once_with_both_workarounds(
        tmp_path, caplog, monkeypatch):
    """MLflow's default pool (env unset: 10 threads), Composer's default (asynchronous): one
    warning for a run of two fits, naming the risk and both workarounds; the user's
    environment is left as it was."""
    monkeypatch.delenv(ENV, raising=False)
    warned = _fit(tmp_path, caplog, fits=2)
    assert len(warned) == 1
    assert "[Errno 17] File exists" in warned[0]
    assert "loggers.mlflow.synchronous: true" in warned[0] and f"{ENV}=1" in warned[0]
    assert ENV not in os.environ


def test_a_synchronous_logger_is_not_warned(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert _fit(tmp_path, caplog, synchronous=True) == []


def test_one_writer_thread_is_not_warned(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert _fit(tmp_path, caplog) == []


@pytest.mark.parametrize(("uri", "env", "expected"), [
    ("databricks", None, False),
    ("http://mlflow.example:5000", None, False),
    ("sqlite:///mlflow.db", None, False),  # SQLAlchemy store: no per-metric folders
    ("/abs/mlruns", None, True),  # a plain path is a file store
    ("mlruns", "4", True),
    ("file:///abs/mlruns", "0", True),  # MLflow: `.get() or 10`
    ("file:///abs/mlruns", "1", False),
])
def test_which_tracking_uris_and_pools_race(tmp_path, monkeypatch, uri, env, expected):
    """The predicate on a real MLFlowLogger (built on a file store, then pointed elsewhere:
    building one at a server would contact it)."""
    from composer.loggers import MLFlowLogger

    logger = MLFlowLogger(tracking_uri=f"file://{tmp_path}/mlruns", experiment_name="fp8")
    logger.tracking_uri = uri
    assert mlflow_races(logger, {} if env is None else {ENV: env}) is expected


@pytest.mark.parametrize(("env", "warned"), [(None, 1), ("4", 1), ("1", 0)])
def test_fp8_lint_in_the_run_judges_the_pool_it_runs_with(tmp_path, monkeypatch, env, warned):
    """The `fp8_lint` callback lints the run's config inside the run, where the environment is
    known: FP8051 stays for MLflow's pool of several writer threads, and not for one, the
    workaround FP8051 itself names (it used to warn then too, while fp8_stats did not). The pool
    as MLflow itself reads it (`environment_variables`, `.get() or 10`) is the reference."""
    from mlflow.environment_variables import MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE

    from foundry_fp8.composer.lint import FP8Lint

    if env is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, env)
    assert ((MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE.get() or 10) > 1) is bool(warned)
    config = {"callbacks": {"fp8_stats": {}, "fp8_lint": {"fail_on": "never"}},
              "loggers": {"mlflow": {"tracking_uri": f"file://{tmp_path}/mlruns"}}}
    found = [f for f in FP8Lint(config, fail_on="never").findings if f.rule == "FP8051"]
    assert [(f.key, f.severity) for f in found] == [("loggers.mlflow", "warning")] * warned
