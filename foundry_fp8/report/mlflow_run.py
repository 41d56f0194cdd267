"""Reading an MLflow run for the report with MLflow's own client (`MlflowClient`): what a
Databricks or MosaicML user, whose runs log to MLflow only, has. `foundry-fp8 report` takes a
file store's run folder (`mlruns/<experiment id>/<run id>`, told by its meta.yaml), an
experiment folder or store holding one run, or `mlflow:<run id>` at MLFLOW_TRACKING_URI.
MLflow is optional: without it, reading such a run is one line."""

from __future__ import annotations

import ast
import os
import stat
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from foundry_fp8.health import RunMetrics
from foundry_fp8.health.keys import LAYER_PREFIX, LAYOUT, MARKERS, SUMMARY_PREFIX, parse_key
from foundry_fp8.health.table import one_line
from foundry_fp8.mlflow_facts import DEFAULT_STORE, TRACKING_URI, env_tracking_uri, file_store
from foundry_fp8.paths import run_folder, safe_run_name
from foundry_fp8.report.read import GuardSeries, NoStatistics, ReportError, _read, _restarts_said

#: `foundry-fp8 report mlflow:<run id>`: the run at MLFLOW_TRACKING_URI (MLflow's own default).
SCHEME = "mlflow:"
#: Composer's MLFlowLogger skips a value equal to the key's last logged one unless
#: `log_duplicated_metric_every_n_steps` steps have passed since (its default, 100:
#: composer/loggers/mlflow_logger.py, __init__ and log_metrics): the report puts those back.
DUPLICATE_WINDOW = 100
#: How many runs a folder that holds several names.
RUNS_NAMED = 5


@dataclass(frozen=True)
class MlflowRun:
    """Where one MLflow run is: `tracking_uri` None for MLflow's own (MLFLOW_TRACKING_URI)."""

    tracking_uri: str | None
    run_id: str
    where: Path  # as the messages name it: the folder or `mlflow:<run id>` given
    note: str = ""  # what the messages add on the store read

    def failed(self, message: str) -> ReportError:
        """MLflow's error, one line, naming the run and the store read where not told, and a
        metric file left unfinished, the likeliest cause (`unfinished`)."""
        cut = unfinished(self)
        said = (f" ({len(cut)} metric file(s) end mid-line, as a run killed while MLflow wrote "
                f"them leaves them, first {next(iter(cut.values()))}: MLflow's client reads "
                "none of the run while one holds no whole line; delete that file or its last "
                "line)" if cut else f" ({bad})" if (bad := malformed(self)) is not None else "")
        return ReportError(f"{self.where}: MLflow: {one_line(message)}{said}{self.note}")


def _run_dir(run: MlflowRun) -> Path | None:
    """The run's folder in a local file store (`<store>/<experiment id>/<run id>`), or None
    (a tracking server, or not found)."""
    uri = run.tracking_uri or env_tracking_uri(os.environ) or DEFAULT_STORE
    if not file_store(uri):
        return None
    parsed = urlparse(uri)
    store = Path(unquote(parsed.path) if parsed.scheme == "file" else uri)
    return next((meta.parent for meta in store.glob(f"*/{run.run_id}/meta.yaml")), None)


def unfinished(run: MlflowRun) -> dict[str, Path]:
    """{metric key: file} of a file-store run's metric files whose last line has no newline:
    MLflow's file store appends `timestamp value step` and a newline per point
    (mlflow 2.22 store/tracking/file_store.py:990, `_log_run_metric`), so a process killed
    mid-append leaves a line cut short, which MLflow's reader takes as it is
    (`_get_metric_from_line`): cut to two fields it is a point at step 0 holding a later
    step's value, cut shorter (or an empty file) an error for the whole run. ReportError (one
    line) for an entry of the run's metrics, params or tags that is neither a file nor a
    folder: MLflow's client opens every one, and a FIFO there would block the report forever."""
    folder = _run_dir(run)
    if folder is None:
        return {}
    cut: dict[str, Path] = {}
    for path in sorted(p for part in ("metrics", "params", "tags")
                       for p in (folder / part).rglob("*")):
        try:
            mode = path.stat().st_mode
        except OSError:
            continue  # unreadable: MLflow's client says so when it reads it
        if stat.S_ISDIR(mode):
            continue
        if not stat.S_ISREG(mode):
            raise ReportError(f"{run.where}: {path}: neither a file nor a folder, where MLflow "
                              "keeps a metric, param or tag in a file (MLflow's client would "
                              "wait on it forever)")
        if path.is_relative_to(folder / "metrics") and not _ends_a_line(path):
            cut[path.relative_to(folder / "metrics").as_posix()] = path
    return cut


def malformed(run: MlflowRun) -> str | None:
    """`file:line: why` of the first line of a file-store run's metric files that MLflow's
    reader refuses (mlflow 2.22 store/tracking/file_store.py:806 `_get_metric_from_line`: UTF-8
    `timestamp value` or `timestamp value step`), for MLflow's error, which names neither the
    file nor the line (`invalid literal for int() with base 10: 'x'`). Read only once MLflow
    failed, a line at a time."""
    folder = _run_dir(run)
    if folder is None:
        return None
    for path in sorted((folder / "metrics").rglob("*")):
        try:
            if not path.is_file():
                continue
            with open(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    if (why := _refused(raw)) is not None:
                        return f"{path}:{lineno}: {why}"
        except OSError:
            continue  # unreadable: MLflow's error says so
    return None


def _refused(raw: bytes) -> str | None:
    """Why MLflow's file store refuses one metric line (`malformed`); None where it reads it."""
    try:
        parts = raw.decode("utf-8").strip().split(" ")
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (byte {e.start} of the line)"
    if len(parts) not in (2, 3):
        return f"{len(parts)} field(s), not `timestamp value step`"
    try:
        int(parts[0]), float(parts[1]), [int(step) for step in parts[2:]]
    except ValueError:
        return f"not `timestamp value step`: {' '.join(parts)[:80]!r}"
    return None


def _ends_a_line(path: Path) -> bool:
    """Whether the file's last byte is a newline (its last byte alone read: a long run's metric
    files are megabytes each); True where it cannot be read (MLflow's client says so)."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return False
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"
    except OSError:
        return True


def _history(client: Any, run: MlflowRun, logged: str, cut: Mapping[str, Path]) -> list[Any]:
    """One metric's history as MLflow's client reads it, in the file's order, less the last
    point of a file left unfinished (`unfinished`): not a value the run logged."""
    history = list(client.get_metric_history(run.run_id, logged))
    return history[:-1] if logged in cut else history


def _run_id(folder: Path) -> str | None:
    """The run id of a file store's run folder, from its meta.yaml (`run_id: ...`)."""
    meta = folder / "meta.yaml"
    if not (meta.is_file() and (folder / "metrics").is_dir()):
        return None
    try:
        lines = meta.read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((line.partition(":")[2].strip().strip("'\"") for line in lines
                 if line.startswith("run_id:")), None)


def _without_meta(folder: Path) -> bool:
    """Whether `folder` is laid out as a file store's run folder (the `metrics` and `tags`
    folders MLflow creates with the run) but lacks the meta.yaml `_run_id` reads."""
    return ((folder / "metrics").is_dir() and (folder / "tags").is_dir()
            and not (folder / "meta.yaml").exists())


def mlflow_run(given: Path) -> MlflowRun | None:
    """The MLflow run `foundry-fp8 report GIVEN` names, or None where GIVEN names none (a
    folder holding metrics.jsonl is the jsonl logger's). ReportError (one line) for a folder
    holding several runs."""
    text = str(given)
    if text.startswith(SCHEME):
        run_id = text.removeprefix(SCHEME)
        if not run_id:
            raise ReportError(f"{text}: no run id (foundry-fp8 report mlflow:<run id>, the "
                              "tracking server in MLFLOW_TRACKING_URI)")
        run = MlflowRun(None, run_id, given)
        _mlflow(run)  # one line where MLflow is not installed, before which store it would read
        if env_tracking_uri(os.environ) is not None:  # MLflow's own store
            return run
        # MLflow's default store is ./mlruns, which its client creates when absent
        # (mlflow/tracking/_tracking_service/utils.py get_tracking_uri, FileStore): a read-only
        # command makes no folder
        if not Path(DEFAULT_STORE).is_dir():
            raise ReportError(f"{text}: {TRACKING_URI} is not set, and MLflow's default store, "
                              f"{DEFAULT_STORE}, is not here: set {TRACKING_URI} to the run's "
                              "tracking server, or name the run's folder (mlruns/<experiment "
                              "id>/<run id>)")
        return MlflowRun(Path(DEFAULT_STORE).resolve().as_uri(), run_id, given,
                         f" ({TRACKING_URI} is not set: read {DEFAULT_STORE})")
    if not given.is_dir() or (given / "metrics.jsonl").exists():
        return None
    runs = [(given, _run_id(given))]  # a run folder; else an experiment folder, or the store
    if runs[0][1] is None:
        runs = [(f, i) for f in sorted([*given.glob("*/"), *given.glob("*/*/")])
                if (i := _run_id(f)) is not None]
    if not runs:
        if (bare := next((f for f in sorted([given, *given.glob("*/"), *given.glob("*/*/")])
                          if _without_meta(f)), None)) is not None:
            where = f"{given}: {bare}" if bare != given else str(given)
            raise ReportError(f"{where}: an MLflow run folder (metrics/, tags/) without its "
                              "meta.yaml, which MLflow's client needs to read the run (copied "
                              "without it?): copy the run's meta.yaml back into it")
        return None
    if len(runs) > 1:
        names = ", ".join(str(f) for f, _ in runs[:RUNS_NAMED])
        raise ReportError(f"{given}: {len(runs)} MLflow runs ({names}"
                          f"{', ...' if len(runs) > RUNS_NAMED else ''}): name one run's folder")
    folder, run_id = runs[0]
    store = folder.resolve().parent.parent  # mlruns/<experiment id>/<run id>
    return MlflowRun(store.as_uri(), str(run_id), given)


def _param(value: str) -> Any:
    """A param as logged: MLflow keeps `str(value)`, a dict's Python repr for LLM-Foundry's
    config sections and fp8_guard's records. One cut at 6000 characters stays text."""
    if value[:1] in "{[":
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return value
    return value


def _logger_options(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """The run's `loggers.mlflow` options (LLM-Foundry logs its config), or none."""
    loggers = params.get("loggers")
    options = loggers.get("mlflow") if isinstance(loggers, Mapping) else None
    return options if isinstance(options, Mapping) else {}


@dataclass
class Points:
    """Metric points as MLflow's client gives them, (timestamp, step, key, value), held as
    arrays: 32 bytes a point, where tuples of MLflow's numbers took some 240 (with the records
    built from them, 4 GB for an MPT-1B run's 18 million points)."""

    stamps: array[int] = field(default_factory=lambda: array("q"))
    steps: array[int] = field(default_factory=lambda: array("q"))
    keys: array[int] = field(default_factory=lambda: array("q"))  # into `names`
    values: array[float] = field(default_factory=lambda: array("d"))
    names: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, points: Iterable[tuple[int, int, str, float]]) -> Points:
        held = cls()
        for stamp, step, key, value in points:
            held.stamps.append(stamp)
            held.steps.append(step)
            held.keys.append(held.names.setdefault(key, len(held.names)))
            held.values.append(value)
        return held

    def __bool__(self) -> bool:
        return bool(self.steps)


#: Points turned back into Python numbers at a time (`_records`).
_CHUNK = 1 << 12


def _records(points: Points) -> Iterator[tuple[int, dict[str, float]]]:
    """(step, {key: value}) in the order logged, from (timestamp, step, key, value): a new
    record where the step changes, so a later attempt's steps (a resume, fit() again with
    reset_time) come after the earlier attempt's, as in the jsonl logger's file. One record at
    a time: the report folds each in."""
    import numpy as np

    names = list(points.names)
    # MLflow keeps no order of a step's keys: by name (the report puts the layers in the
    # model's order, `RunMetrics.in_order`), so that equal timestamps read the same every time;
    # lexsort is stable: points equal in all three stay in the order MLflow's client gave them
    rank = np.empty(len(names), dtype=np.int64)
    rank[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
    keys = np.frombuffer(points.keys, dtype=np.int64)
    steps = np.frombuffer(points.steps, dtype=np.int64)
    order = np.lexsort((rank[keys], steps, np.frombuffer(points.stamps, dtype=np.int64)))
    values = np.frombuffer(points.values, dtype=np.float64)
    record: tuple[int, dict[str, float]] | None = None
    for start in range(0, len(order), _CHUNK):
        at = order[start:start + _CHUNK]
        for step, key, value in zip(steps[at].tolist(), keys[at].tolist(), values[at].tolist(),
                                    strict=True):
            if record is None or record[0] != step:
                if record is not None:
                    yield record
                record = (step, {})
            record[1][names[key]] = value
    if record is not None:
        yield record


def _filled(records: Iterable[tuple[int, dict[str, float]]], window: int
            ) -> Iterator[tuple[int, dict[str, float]]]:
    """`records` with the values Composer's MLflow logger skipped as duplicates put back
    (DUPLICATE_WINDOW): at a logging step (one holding a per-layer series) a key not logged
    there within `window` steps of its last logged value held that value. Not the markers
    (`MARKERS`): logged only where 1, a row without one is unmarked. (A marker 1 skipped as a
    duplicate is not told from one not logged: `log_duplicated_metric_every_n_steps: 0` keeps
    every value.)"""
    last: dict[str, tuple[float, int]] = {}
    for step, metrics in records:
        logged = dict(metrics)
        if any(key.startswith(LAYER_PREFIX) for key in logged):
            for key, (value, at) in last.items():
                if key not in logged and step < at + window:
                    metrics[key] = value
        last.update({key: (value, step) for key, value in logged.items()
                     if (parsed := parse_key(key)) is None or parsed[0] not in MARKERS})
        yield step, metrics


def _mlflow(run: MlflowRun) -> tuple[Any, type[Exception]]:
    """MLflow's client class and its exception class; one line where MLflow is not installed."""
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ReportError(f"{run.where}: an MLflow run: reading it needs MLflow, not installed "
                          "here (pip install mlflow)") from None
    return MlflowClient, MlflowException


def load_mlflow(run: MlflowRun, warn: Callable[[str], None]
                ) -> tuple[RunMetrics, GuardSeries, dict[str, Any]]:
    """The run's per-layer FP8 metrics, fp8_guard's series and its params (parsed back from
    text), read with MLflow's client: each `fp8*` metric's history. Keys the run's MLflow logger
    renamed (`rename_metrics`) are named back."""
    client_class, mlflow_error = _mlflow(run)
    cut = unfinished(run)
    if cut:
        warn(f"{run.where}: {len(cut)} MLflow metric file(s) end mid-line, as a run killed "
             f"while MLflow wrote them leaves them (first {next(iter(cut.values()))}): their "
             "last point is left out")
    try:
        client = client_class(tracking_uri=run.tracking_uri)
        data = client.get_run(run.run_id).data
        params = {key: _param(value) for key, value in data.params.items()}
        options = _logger_options(params)
        renamed = options.get("rename_metrics")
        named = {new: old for old, new in renamed.items()} if isinstance(renamed, Mapping) else {}
        points = Points.of((m.timestamp, m.step, key, m.value)
                           for logged in data.metrics if (key := named.get(logged, logged))
                           .startswith((LAYER_PREFIX, SUMMARY_PREFIX))
                           for m in _history(client, run, logged, cut))
    except (mlflow_error, ValueError) as e:  # the file store's ValueError: a line cut short
        raise run.failed(str(e)) from None
    window = options.get("log_duplicated_metric_every_n_steps", DUPLICATE_WINDOW)
    window = window if isinstance(window, int) and not isinstance(window, bool) else DUPLICATE_WINDOW
    guard: GuardSeries = {}
    metrics, restarts = _read(_filled(_records(points), window), guard)
    if restarts:
        warn(_restarts_said(run.where, restarts))
    if not metrics.values:
        said = (f"only fp8_stats' summary series, no per-layer series ({LAYOUT}) to say "
                "which layer (left out by the logger's ignore_metrics?)"
                if points else "no FP8 statistics: was fp8_stats in the YAML?")
        raise NoStatistics(f"{run.where}: MLflow run {run.run_id}: {said}")
    return metrics, guard, params


def mlflow_params(run: MlflowRun) -> dict[str, Any]:
    """The run's params, parsed back from text (`_param`), read with MLflow's client."""
    client_class, mlflow_error = _mlflow(run)
    unfinished(run)  # one line for a file MLflow's client would wait on
    try:
        params = client_class(tracking_uri=run.tracking_uri).get_run(run.run_id).data.params
    except (mlflow_error, ValueError) as e:  # the file store's ValueError: a line cut short
        raise run.failed(str(e)) from None
    return {key: _param(value) for key, value in params.items()}


def mlflow_history(run: MlflowRun, key: str) -> Iterator[tuple[int, dict[str, float]]]:
    """(step, {key: value}) of one metric's history, in the order logged (`_records`), read with
    MLflow's client under the name the run's MLflow logger gave it (`rename_metrics`)."""
    client_class, mlflow_error = _mlflow(run)
    cut = unfinished(run)
    try:
        client = client_class(tracking_uri=run.tracking_uri)
        params = {k: _param(v) for k, v in client.get_run(run.run_id).data.params.items()}
        renamed = _logger_options(params).get("rename_metrics")
        logged = renamed.get(key, key) if isinstance(renamed, Mapping) else key
        points = Points.of((m.timestamp, m.step, key, m.value)
                           for m in _history(client, run, str(logged), cut))
    except (mlflow_error, ValueError) as e:  # the file store's ValueError: a line cut short
        raise run.failed(str(e)) from None
    return _records(points)


#: The tag Composer's MLFlowLogger gives a run: the Composer run name (composer 0.32.1
#: loggers/mlflow_logger.py:344, `tags['run_name']`, for its autoresume).
RUN_NAME_TAG = "run_name"


def run_folder_of(run: MlflowRun, params: Mapping[str, Any]) -> Path | None:
    """The run's folder, where fp8_stats' dumps are: Composer's (`paths.run_folder`: the parent
    of a local `save_folder` param, else `runs/<run name>`), in the working directory the run
    started in, taken to be the one holding a file store (MLflow's default, ./mlruns, is there)
    or, for a tracking server, the report's. The run name is Composer's tag (LLM-Foundry's
    `run_name` param where absent). None where neither says it."""
    client_class, mlflow_error = _mlflow(run)
    try:
        tags = client_class(tracking_uri=run.tracking_uri).get_run(run.run_id).data.tags
    except (mlflow_error, ValueError):  # the file store's ValueError: a line cut short
        return None
    name = tags.get(RUN_NAME_TAG) or params.get("run_name")
    if not isinstance(name, str) or not name:
        return None
    save_folder = params.get("save_folder")  # its `{run_name}` as Composer fills it in
    folder = run_folder(save_folder.replace("{run_name}", safe_run_name(name))
                        if isinstance(save_folder, str) else None, name)
    uri = run.tracking_uri or env_tracking_uri(os.environ) or DEFAULT_STORE
    started = Path(".")
    if file_store(uri):
        store = urlparse(uri)
        started = Path(unquote(store.path) if store.scheme == "file" else uri).parent
    return started / folder
