"""`foundry-fp8 report` of an MLflow run whose metric file holds a line MLflow's reader refuses
mid-file (a damaged disk block, a hand edit): MLflow's error names neither file nor line
(`invalid literal for int() with base 10: 'garbage'`); the report's one line now names both."""

from __future__ import annotations

import pytest

from foundry_fp8.health import layer_key
from foundry_fp8.report.cli import load
from foundry_fp8.report.read import ReportError

KEY = layer_key("underflow_pct", "weight", "blocks.0.fc")


def test_a_line_mlflow_refuses_is_named_by_file_and_line(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    try:
        with mlflow.start_run() as run:
            for step in range(3):
                mlflow.log_metrics({KEY: 0.1 * step, "loss/train/total": 3.0}, step=step)
    finally:
        mlflow.set_tracking_uri("")
    folder = tmp_path / "mlruns" / run.info.experiment_id / run.info.run_id
    metric = folder / "metrics" / KEY
    with metric.open("a") as f:
        f.write("garbage line here\n1700000000000 0.5 3\n")  # whole lines: not a cut one
    with pytest.raises(ReportError) as e:
        load(folder)
    assert str(e.value).endswith(f"({metric}:4: not `timestamp value step`: 'garbage line "
                                 "here')"), e.value


@pytest.mark.parametrize("line", [b"1 2 3\n", b"1 2\n", b"1 nan 3\n", b"1 2 3 4\n", b"x 2 3\n",
                                  b"1 2 x\n", b"\n", b"1  2\n", b"\xff 1 2\n", b"1 2.5e3 -4\n",
                                  b"1 " + b"9" * 5000 + b" 2\n", b"1 2 " + b"9" * 5000 + b"\n"])
def test_refused_lines_are_those_mlflows_reader_refuses(line):
    """Against MLflow's own line parser (mlflow 2.22 FileStore._get_metric_from_line)."""
    from mlflow.store.tracking.file_store import FileStore

    from foundry_fp8.report.mlflow_run import _refused

    try:
        FileStore._get_metric_from_line("k", line.decode("utf-8"), "0")
        mlflow_reads = True
    except Exception:  # MlflowException, ValueError, UnicodeDecodeError
        mlflow_reads = False
    assert (_refused(line) is None) == mlflow_reads, (line[:40], _refused(line))
