"""In a run, `fp8_lint`'s FP8051 and `fp8_stats`' FIT_START warning judge MLflow's file-store race
(foundry_fp8/mlflow_facts.py) alike, over every mix of the config's `tracking_uri`, the run's
MLFLOW_TRACKING_URI and DATABRICKS_TOKEN, MLflow's pool size variable and `synchronous`. The
reference is the other projects' own answers: the URI a real Composer MLFlowLogger resolves
(composer loggers/mlflow_logger.py:217-221), MLflow's store registry for whether it is a file
store, and the pool MLflow itself would build (`MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE.get() or 10`
into a ThreadPoolExecutor, async_logging_queue.py:337-344; a value either refuses is no pool).
fp8_lint used to warn for a server URI from the environment, fp8_stats for a pool size MLflow
refuses."""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from foundry_fp8.lint.cli import lint_file
from tests.test_lint import NO_FLASH, _write

pytest.importorskip("mlflow")

POOL = "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE"
ENV_URIS = (None, "http://mlflow.example:5000", "file")
TOKENS = (None, "dapi-x")
POOLS = (None, "1", "1 ", "01", "0", "4", "abc")
CONFIG_URIS = (None, "file", "path", "http://mlflow.example:5000", "databricks")


def _mlflow_pool() -> int | None:
    """The writer threads MLflow's async logging queue would start under os.environ; None where
    it raises instead (a value int() refuses, or ThreadPoolExecutor's max_workers <= 0)."""
    from mlflow.environment_variables import MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE

    try:
        pool = ThreadPoolExecutor(max_workers=MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE.get() or 10)
    except ValueError:
        return None
    pool.shutdown()
    return pool._max_workers


def _set(monkeypatch: pytest.MonkeyPatch, name: str, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("synchronous", [False, True])
@pytest.mark.parametrize("config_uri", CONFIG_URIS)
def test_fp8_lint_and_fp8_stats_agree_with_composer_and_mlflow(tmp_path, monkeypatch,
                                                                config_uri, synchronous):
    from composer.loggers import MLFlowLogger
    from mlflow.tracking._tracking_service import utils

    from foundry_fp8.composer.lint import FP8Lint
    from foundry_fp8.composer.stats import mlflow_races

    monkeypatch.chdir(tmp_path)  # MLflow's default ./mlruns lands here
    # offline construction: no experiment lookup, no Databricks user lookup
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", "0")
    uri = {"file": (tmp_path / "cfg").as_uri(), "path": str(tmp_path / "plain")}.get(
        config_uri, config_uri)
    mlflow_config = {"synchronous": synchronous} | ({} if uri is None else {"tracking_uri": uri})
    config = {"callbacks": {"fp8_stats": {}, "fp8_lint": {"fail_on": "never"}},
              "loggers": {"mlflow": mlflow_config}}
    wrong, racing = [], 0
    for env_uri, token, pool in itertools.product(ENV_URIS, TOKENS, POOLS):
        _set(monkeypatch, "MLFLOW_TRACKING_URI",
             (tmp_path / "env").as_uri() if env_uri == "file" else env_uri)
        _set(monkeypatch, "DATABRICKS_TOKEN", token)
        _set(monkeypatch, POOL, pool)
        monkeypatch.setattr(utils, "_tracking_uri", None)  # the previous logger set it
        logger = MLFlowLogger(tracking_uri=uri, experiment_name="/Users/u/fp8",
                              synchronous=synchronous)
        workers = _mlflow_pool()
        file_store = utils._tracking_store_registry.get_store_builder(logger.tracking_uri) \
            is utils._get_file_store
        expected = file_store and not synchronous and workers is not None and workers > 1
        lint = [f for f in FP8Lint(config, fail_on="never").findings if f.rule == "FP8051"]
        stats = mlflow_races(logger, os.environ)
        case = (env_uri, token, pool, logger.tracking_uri, workers)
        if bool(lint) is not expected or stats is not expected:
            wrong.append((*case, "lint", bool(lint), "stats", stats, "expected", expected))
        if lint and "the linter cannot see" in lint[0].message:
            wrong.append((*case, "tail in the run"))
        racing += expected
    assert wrong == []
    # not vacuous: the file URIs race with several threads and no server
    assert racing == {(None, False): 6, ("file", False): 18, ("path", False): 18}.get(
        (config_uri, synchronous), 0)


def test_the_file_linter_judges_the_file_alone(tmp_path, monkeypatch):
    """`foundry-fp8 lint` runs where the config is written, not where the run starts: the
    environment it sees says nothing about the run's, so it warns and says what it cannot see."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    monkeypatch.setenv(POOL, "1")
    entry = lint_file(_write(tmp_path, {"callbacks": {"fp8_stats": {}},
                                        "loggers": {"mlflow": {}}}), 1, NO_FLASH)
    found = [f for f in entry["findings"] if f["rule"] == "FP8051"]
    assert len(found) == 1
    assert found[0]["message"].endswith(f"(the linter cannot see the run's environment: {POOL}=1 "
                                        "there also avoids it)")
