"""`foundry-fp8 report RUN --baseline BASE`: the training loss of both runs, read as the run
itself is (the `jsonl` logger's metrics.jsonl, a W&B offline run with W&B's reader, an MLflow run
with MLflow's client), for `health.loss.compare`. Bad input is one line (ReportError)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from foundry_fp8 import jsonl, wandb_history
from foundry_fp8.health.keys import LOSS
from foundry_fp8.jsonl import JsonlError, read_jsonl
from foundry_fp8.report.mlflow_run import mlflow_history, mlflow_run
from foundry_fp8.report.read import (
    ReportError,
    _attempts,
    _json_document,
    metrics_file_of,
    wandb_files,
)


def _losses(records: Iterable[tuple[int, Mapping[str, Any]]]) -> dict[int, float]:
    """step -> loss of `records`, a later attempt's (the steps went back: a resume) replacing
    what earlier ones logged from its first step on, as the report's metrics are (`_attempts`)."""
    losses: dict[int, float] = {}

    def restarted(_: int, step: int) -> None:
        for later in [s for s in losses if s >= step]:
            del losses[later]

    for step, metrics in _attempts(records, restarted):
        value = jsonl.number(metrics.get(LOSS))
        if value is not None:
            losses[step] = value
    return losses


def read_losses(given: Path) -> dict[int, float]:
    """step -> training loss (`health.keys.LOSS`) of the run GIVEN names, however the report
    reads runs; ReportError (one line) where GIVEN is no run or logged no loss."""
    if (ml := mlflow_run(given)) is not None:
        losses = _losses(mlflow_history(ml, LOSS))
    elif (files := wandb_files(given)) is not None:
        try:
            runs = [wandb_history.read_run(path) for path in files]
        except Exception:  # noqa: BLE001 - W&B's reader raises whatever its parsers do
            raise ReportError(f"{files[0]}: W&B's reader cannot read it") from None
        losses = _losses((row["_step"], row) for run in runs for row in run.rows
                         if jsonl.step(row.get("_step")) is not None)
    else:
        metrics_file = metrics_file_of(given)
        try:
            losses = _losses(read_jsonl(metrics_file))
        except JsonlError as e:
            raise ReportError(_json_document(metrics_file) or str(e)) from None
        except OSError as e:
            raise ReportError(f"{metrics_file}: cannot read ({e.strerror or e})") from None
    if not losses:
        raise ReportError(f"{given}: no `{LOSS}` logged (the training loss Composer logs at every "
                          "batch), nothing to compare")
    return losses


def read_baseline(given: Path) -> dict[int, float]:
    """The baseline's losses (`read_losses`), one line naming `--baseline` where they do not
    read or none is finite (it diverged itself: nothing to compare with)."""
    try:
        losses = read_losses(given)
    except ReportError as e:
        raise ReportError(f"--baseline {e}") from None
    if not any(map(math.isfinite, losses.values())):
        raise ReportError(f"--baseline {given}: `{LOSS}` is NaN/Inf at each of its "
                          f"{len(losses)} logged steps, nothing to compare with")
    return losses


def run_identity(given: Path) -> str:
    """What names the run GIVEN is, however it was given (a folder, its metrics.jsonl, its
    wandb/ or mlruns/ folder, mlflow:<id>): the MLflow run id or the resolved file read."""
    if (ml := mlflow_run(given)) is not None:
        return f"MLflow run {ml.run_id}"
    if (files := wandb_files(given)) is not None:
        return str(files[0].resolve())
    return str(metrics_file_of(given).resolve())


def same_run(run: Path, losses: Mapping[int, float], baseline: Path,
             base: Mapping[int, float]) -> str | None:
    """Why `--baseline` is the run itself (the same run given twice, or a copy: the same loss
    at every step), where it is; a comparison with itself says nothing."""
    if run_identity(run) == run_identity(baseline):
        return f"--baseline {baseline} is this run ({run_identity(run)})"
    if losses.keys() == base.keys() and all(
            a == b or not (math.isfinite(a) or math.isfinite(b))
            for a, b in ((losses[s], base[s]) for s in losses)):
        return (f"--baseline {baseline} logged this run's loss at each of its {len(base)} steps: "
                "the same run (or a copy)?")
    return None
