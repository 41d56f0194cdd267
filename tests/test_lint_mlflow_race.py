"""FP8051: `loggers.mlflow` logging asynchronously to a local file store in a config with
fp8_stats. MLflow's writer threads race creating a new metric's folder (`[Errno 17] File
exists`) and drop the whole batch, Composer's loss included (foundry_fp8/mlflow_facts.py);
fp8_stats' first logging step brings many new keys at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundry_fp8.lint.cli import lint_file
from tests.test_lint import NO_FLASH, _write

STATS = {"callbacks": {"fp8_stats": {}}}


def _fp8051(tmp_path: Path, mlflow: dict | None, extra: dict = STATS) -> list[dict]:
    entry = lint_file(_write(tmp_path, {**extra, "loggers": {"mlflow": mlflow}}), 1, NO_FLASH)
    assert entry["error"] is None, entry["error"]
    return [f for f in entry["findings"] if f["rule"] == "FP8051"]


@pytest.mark.parametrize(("mlflow", "key", "where"), [
    ({}, "loggers.mlflow", "MLflow's default tracking URI (./mlruns"),
    (None, "loggers.mlflow", "MLflow's default tracking URI (./mlruns"),
    ({"tracking_uri": "file:///data/mlruns"}, "loggers.mlflow", "'file:///data/mlruns'"),
    ({"tracking_uri": "runs/mlruns"}, "loggers.mlflow", "'runs/mlruns'"),
    ({"tracking_uri": "/data/mlruns", "synchronous": False}, "loggers.mlflow.synchronous",
     "'/data/mlruns'"),
])
def test_an_asynchronous_file_store_is_a_warning_with_both_workarounds(tmp_path, mlflow, key,
                                                                        where):
    found = _fp8051(tmp_path, mlflow)
    assert [(f["key"], f["severity"]) for f in found] == [(key, "warning")]
    assert where in found[0]["message"]
    assert "[Errno 17] File exists" in found[0]["message"]
    assert "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE=1 there also avoids it" in found[0]["message"]
    assert found[0]["fix"] == "set loggers.mlflow.synchronous: true, or " \
        "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE=1 in the run's environment"


@pytest.mark.parametrize(("mlflow", "extra"), [
    ({"synchronous": True}, STATS),
    ({"tracking_uri": "databricks"}, STATS),
    ({"tracking_uri": "http://mlflow.example:5000"}, STATS),
    ({"tracking_uri": "sqlite:///mlflow.db"}, STATS),  # no per-metric folders
    ({"tracking_uri": "${oc.env:MLFLOW_URI}"}, STATS),  # known only where the run starts
    ({}, {}),  # no fp8_stats
])
def test_not_flagged(tmp_path, mlflow, extra):
    assert _fp8051(tmp_path, mlflow, extra) == []


def test_composers_default_tracking_uri_is_a_file_store(tmp_path, monkeypatch):
    """No tracking_uri: Composer's MLFlowLogger takes mlflow.get_tracking_uri(), a `file:` URI
    of ./mlruns (MLflow's own answer), which MLflow's store registry opens as a FileStore."""
    from composer.loggers import MLFlowLogger
    from mlflow.store.tracking.file_store import FileStore
    from mlflow.tracking._tracking_service import utils
    from mlflow.tracking._tracking_service.utils import _get_store

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(utils, "_tracking_uri", None)  # an earlier MLFlowLogger set it
    for name in ("MLFLOW_TRACKING_URI", "DATABRICKS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    logger = MLFlowLogger(experiment_name="fp8")
    assert logger.tracking_uri == (tmp_path / "mlruns").as_uri()
    assert isinstance(_get_store(logger.tracking_uri), FileStore)
    assert logger.synchronous is False  # Composer's default: asynchronous


def test_llmfoundry_builds_the_fix(tmp_path):
    """The fix is a key LLM-Foundry's build_logger passes on: a synchronous MLflow logger."""
    from llmfoundry.utils.builders import build_logger

    logger = build_logger("mlflow", {"synchronous": True, "experiment_name": "fp8",
                                     "tracking_uri": (tmp_path / "mlruns").as_uri()})
    assert logger.synchronous is True
