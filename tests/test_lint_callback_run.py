"""`fp8_lint` in a run, beside the run's own warnings and MLflow: a path that repeats the run
folder (FP8052) is said once, not by the linter and again by the run; an MLflow pool size MLflow
itself refuses stops the run at fp8_lint's construction in one line, not in the Trainer's with
MLflow's traceback; and FP8051 follows the tracking URI Composer's MLflow logger really takes,
`mlflow.set_tracking_uri` in the process included, as fp8_stats does. References: a real Composer
Trainer, a real MLFlowLogger and MLflow's own pool."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from composer import Trainer
from composer.models import ComposerClassifier
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.lint import FP8Lint
from foundry_fp8.composer.stats import FP8Stats, mlflow_races

mlflow = pytest.importorskip("mlflow")

POOL = "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE"


def _trainer(tmp_path, callbacks=(), loggers=(), run_name: str = "lintrun") -> Trainer:
    model = ComposerClassifier(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                                   torch.nn.Linear(16, 2)), num_classes=2)
    data = DataLoader(TensorDataset(torch.randn(16, 16), torch.randint(0, 2, (16,))),
                      batch_size=4)
    return Trainer(model=model, train_dataloader=data, max_duration="2ba", run_name=run_name,
                   callbacks=list(callbacks), loggers=list(loggers), progress_bar=False,
                   log_to_console=False)


def test_a_path_repeating_the_run_folder_is_said_once_in_a_run(tmp_path, monkeypatch, caplog):
    """The jsonl path and fp8_stats' dump_folder both begin with the run folder `runs/<name>`:
    fp8_lint's FP8052 and the run's own warning (`paths.say_repeated`) said each of them twice;
    the dump folder is said without dump steps too, where only fp8_lint said it."""
    monkeypatch.chdir(tmp_path)
    name = "repeated"
    jsonl, dumps = "runs/{run_name}/metrics.jsonl", "runs/{run_name}/dumps"
    config = {"run_name": name, "loggers": {"jsonl": {"path": jsonl}},
              "callbacks": {"fp8_lint": {}, "fp8_stats": {"interval": "1ba",
                                                          "dump_folder": dumps}}}
    with caplog.at_level(logging.WARNING):
        lint = FP8Lint(config)
        trainer = _trainer(tmp_path, [lint, FP8Stats(interval="1ba", dump_folder=dumps)],
                           [JSONLLogger(path=jsonl)], run_name=name)
        trainer.fit()
        trainer.close()
    assert sorted(f.key for f in lint.findings if f.rule == "FP8052") == [
        "callbacks.fp8_stats.dump_folder", "loggers.jsonl.path"]  # still counted
    said = [r.getMessage() for r in caplog.records]
    for key, template in (("loggers.jsonl.path", jsonl), ("callbacks.fp8_stats.dump_folder", dumps)):
        assert len([m for m in said if f"{key}: {template!r} begins with the run folder" in m]) \
            == 1, (key, said)
    # taken the old way: inside the run folder, not doubled
    assert (tmp_path / "runs" / name / "metrics.jsonl").is_file()
    assert not (tmp_path / "runs" / name / "runs").exists()


def _mlflow_refuses(value: str) -> bool:
    """Whether MLflow's asynchronous logging queue refuses this pool size (its own parse into
    its own ThreadPoolExecutor, mlflow utils/async_logging/async_logging_queue.py:337-344)."""
    from mlflow.environment_variables import MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE

    try:
        ThreadPoolExecutor(max_workers=MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE.get() or 10).shutdown()
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("value", ["abc", "", "-1", "1.5", "0", "1", " 2", "10"])
def test_an_mlflow_pool_size_mlflow_refuses_stops_the_run_at_fp8_lint(monkeypatch, value):
    monkeypatch.setenv(POOL, value)
    config = {"loggers": {"mlflow": {}}, "callbacks": {"fp8_lint": {}}}
    if not _mlflow_refuses(value):
        FP8Lint(config)
        return
    with pytest.raises(ValueError) as refused:
        FP8Lint(config)
    message = str(refused.value)
    assert f"{POOL}={value!r}" in message and "\n" not in message
    assert "loggers.mlflow.synchronous: true" in message
    FP8Lint({"loggers": {"mlflow": {"synchronous": True}}})  # MLflow never reads it then
    FP8Lint({"loggers": {"wandb": {}}})


def test_the_refused_pool_size_is_what_stops_composers_trainer(tmp_path, monkeypatch):
    """The reference: a real Trainer with an asynchronous MLflow logger under `abc` dies in its
    constructor with MLflow's ValueError; synchronous, the same run trains."""
    from composer.loggers import MLFlowLogger

    monkeypatch.setenv(POOL, "abc")
    uri = (tmp_path / "mlruns").as_uri()
    with pytest.raises(ValueError, match=f"Failed to convert 'abc' to <class 'int'> for {POOL}"):
        _trainer(tmp_path, loggers=[MLFlowLogger(tracking_uri=uri, experiment_name="e")])
    trainer = _trainer(tmp_path, loggers=[MLFlowLogger(tracking_uri=uri, experiment_name="s",
                                                       synchronous=True)])
    trainer.fit()
    trainer.close()


@pytest.mark.parametrize("set_in_process, environment", [
    ("http://mlflow.example:5000", "file"), ("file", "http://mlflow.example:5000")])
def test_fp8051_follows_the_tracking_uri_set_in_the_process(tmp_path, monkeypatch,
                                                           set_in_process, environment):
    """`mlflow.set_tracking_uri` wins over MLFLOW_TRACKING_URI, also once the variable changed
    after it: Composer's MLflow logger (and fp8_stats, which asks it) takes the URI set, and
    fp8_lint's FP8051 judged the variable."""
    from composer.loggers import MLFlowLogger
    from mlflow.tracking._tracking_service import utils

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "0")  # offline construction: no server lookup
    monkeypatch.setenv(POOL, "4")
    monkeypatch.delenv("DATABRICKS_TOKEN", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # restored last: as it was
    monkeypatch.setattr(utils, "_tracking_uri", None)
    uris = {"file": (tmp_path / "store").as_uri()}
    mlflow.set_tracking_uri(uris.get(set_in_process, set_in_process))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uris.get(environment, environment))
    logger = MLFlowLogger(experiment_name="/Users/u/fp8")
    assert logger.tracking_uri == uris.get(set_in_process, set_in_process)
    config = {"callbacks": {"fp8_stats": {}, "fp8_lint": {"fail_on": "never"}},
              "loggers": {"mlflow": {}}}
    linted = [f for f in FP8Lint(config).findings if f.rule == "FP8051"]
    assert bool(linted) is mlflow_races(logger, os.environ) \
        is (set_in_process == "file")


@pytest.mark.parametrize("layers", [".*", "^nothing$"])
def test_mlflows_file_store_race_is_said_once_in_a_run(tmp_path, monkeypatch, caplog, layers):
    """FP8051 in a run: fp8_lint (at construction) and fp8_stats (at FIT_START) each printed
    MLflow's race; fp8_stats says it now and fp8_lint counts it. Said also where fp8_stats'
    `layers` match nothing and it switches itself off at FIT_START (then only fp8_lint had)."""
    from composer.loggers import MLFlowLogger

    from foundry_fp8.mlflow_facts import RACE

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(POOL, "4")  # asynchronous to a local file store: MLflow's race
    monkeypatch.delenv("DATABRICKS_TOKEN", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    config = {"loggers": {"mlflow": {"tracking_uri": uri}},
              "callbacks": {"fp8_lint": {}, "fp8_stats": {"interval": "1ba", "layers": layers}}}
    with caplog.at_level(logging.WARNING):
        lint = FP8Lint(config)
        logger = MLFlowLogger(tracking_uri=uri, experiment_name="race")
        trainer = _trainer(tmp_path, [lint, FP8Stats(interval="1ba", layers=layers)], [logger])
        trainer.fit()
        trainer.close()
    assert mlflow_races(logger, os.environ)  # the reference: the logger really races
    assert [f.rule for f in lint.findings if f.rule == "FP8051"] == ["FP8051"]  # still counted
    said = [r.getMessage() for r in caplog.records if RACE in r.getMessage()]
    assert len(said) == 1, said
