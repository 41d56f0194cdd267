"""MLflow's file-store race, torch-free so that fp8_stats (at FIT_START) and the linter (FP8051)
read the same facts.

Composer's MLFlowLogger logs asynchronously unless `synchronous: true` (composer 0.31-0.32
loggers/mlflow_logger.py:153, passed to `mlflow.log_metrics`). MLflow (2.21-2.22) writes the
queued batches from a thread pool of `MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE` threads, 10 when
unset or 0 (utils/async_logging/async_logging_queue.py:338), and its file store creates a
metric's folder with an unguarded `os.makedirs` (utils/file_utils.py:215-222
`make_containing_dirs`): two threads creating the same folder raise `[Errno 17] File exists`,
and MLflow logs "Failed to log run data" and drops that whole batch (:206), every metric of
those steps, the loss included. fp8_stats' first logging step brings many new keys at once.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from urllib.parse import urlparse

#: MLflow's environment variable for its asynchronous logging's thread pool.
THREADPOOL_ENV = "MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE"
#: The pool size MLflow takes when the variable is unset or 0 (`.get() or 10`).
THREADPOOL_DEFAULT = 10

#: What goes wrong, in one line.
RACE = ("MLflow's asynchronous logging to a local file store can drop whole batches of "
        "metrics (Composer's loss included): its writer threads race creating a new metric's "
        "folder ('[Errno 17] File exists', 'Failed to log run data'), likeliest at fp8_stats' "
        "first logging step, which brings many new keys")
#: Either avoids it.
WORKAROUNDS = (f"set loggers.mlflow.synchronous: true, or {THREADPOOL_ENV}=1 in the run's "
               "environment")


#: MLflow's variable naming its tracking server, and its store where that is unset or empty
#: (mlflow 2.21-2.22 tracking/_tracking_service/utils.py:127, `elif uri := ...get()`: empty is unset;
#: store/tracking/__init__.py DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH).
TRACKING_URI, DEFAULT_STORE = "MLFLOW_TRACKING_URI", "./mlruns"

#: Tracking URIs MLflow takes by name, not as a path (tracking/registry.py:75-78).
NAMED_STORES = ("databricks", "databricks-uc", "uc")


def composer_tracking_uri(configured: object, environ: Mapping[str, str]) -> str | None:
    """The tracking URI Composer's MLFlowLogger logs to, from its `tracking_uri` and the run's
    environment (composer 0.31-0.32.1 loggers/mlflow_logger.py:217-221): the configured one as
    text, else `databricks` where DATABRICKS_TOKEN is set at all, else mlflow.get_tracking_uri():
    the URI `mlflow.set_tracking_uri` set in this process (`process_tracking_uri`), else a
    non-empty MLFLOW_TRACKING_URI (mlflow 2.21-2.22 tracking/_tracking_service/utils.py:125-128),
    else None, MLflow's default ./mlruns."""
    if configured is not None:
        return str(configured)
    if environ.get("DATABRICKS_TOKEN") is not None:
        return "databricks"
    return process_tracking_uri() or env_tracking_uri(environ)


def process_tracking_uri() -> str | None:
    """The URI `mlflow.set_tracking_uri` set in this process (its module's `_tracking_uri`,
    mlflow 2.21-2.22 tracking/_tracking_service/utils.py:22, :69-72), which MLflow takes before
    MLFLOW_TRACKING_URI, also after that variable changed; None where MLflow is not imported
    (nothing set one: it is not imported here for this) or none was set."""
    module = sys.modules.get("mlflow.tracking._tracking_service.utils")
    uri = getattr(module, "_tracking_uri", None)
    return str(uri) if uri else None


def env_tracking_uri(environ: Mapping[str, str]) -> str | None:
    """The tracking server MLFLOW_TRACKING_URI names; None where unset or empty, which MLflow
    reads alike (its default store, DEFAULT_STORE)."""
    return environ.get(TRACKING_URI) or None


def file_store(tracking_uri: str | None) -> bool:
    """Whether MLflow keeps this tracking URI's runs in a local file store: a `file:` URI or a
    plain path, as MLflow's store registry picks (tracking/_tracking_service/utils.py:185-186);
    None is MLflow's default, ./mlruns."""
    if tracking_uri is None:
        return True
    uri = str(tracking_uri)
    return uri not in NAMED_STORES and urlparse(uri).scheme in ("", "file")


def threadpool_size(environ: Mapping[str, str]) -> int | None:
    """MLflow's asynchronous writer threads under this environment: `int(value) or 10`
    (environment_variables.py `_EnvironmentVariable.get`). None where MLflow has no pool: a
    value `int` refuses ('', 'abc') raises ValueError, and one below 1 ThreadPoolExecutor's
    ValueError, at every asynchronous log (async_logging_queue.py:337-344)."""
    value = environ.get(THREADPOOL_ENV)
    if value is None:
        return THREADPOOL_DEFAULT
    try:
        size = int(value) or THREADPOOL_DEFAULT
    except ValueError:
        return None
    return size if size > 0 else None


def races(tracking_uri: str | None, synchronous: bool, environ: Mapping[str, str]) -> bool:
    """Whether an MLflow logger so configured can lose batches to the race (above):
    `tracking_uri` is the one it logs to (`composer_tracking_uri`)."""
    return file_store(tracking_uri) and not synchronous and (threadpool_size(environ) or 0) > 1
