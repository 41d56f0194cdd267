"""`foundry-fp8 report` of an MLflow file-store run killed while MLflow appended a metric line.

MLflow's file store appends `timestamp value step` and a newline per point; a kill mid-append
leaves the last line cut short. MLflow's own reader takes a line cut to two fields as a point at
step 0 (holding a later step's value), and raises on one holding no whole field. The old report
read such a run as resumed at step 0 (keeping only the "later attempt": half the logging steps
gone, a step-9 value shown at step 0), and answered an empty metric file with a traceback.
The run here is written with MLflow's own client, as Composer's MLFlowLogger writes it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from foundry_fp8.cli import main
from foundry_fp8.report.mlflow_run import load_mlflow, mlflow_run

mlflow = pytest.importorskip("mlflow")

STEPS = (0, 3, 6, 9)
CUT = "fp8_amax/activation/blocks.0.fc"
AMAX = {0: 1.5, 3: 2.25, 6: 3.125, 9: 4.875}  # the cut file's values: each step's its own


def _run(tmp_path: Path) -> Path:
    """A file-store run of two layers' fp8_stats series at STEPS; its folder."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.create_run(client.create_experiment("fp8"))
    for step in STEPS:
        metrics = [Metric(CUT, AMAX[step], 1000 + step, step)]
        metrics += [Metric(f"fp8_{stat}/activation/blocks.{b}.fc", 0.5 * b + step, 1000 + step,
                           step) for b in (0, 1) for stat in ("underflow_pct", "cos_sim")]
        client.log_batch(run.info.run_id, metrics=metrics)
    client.set_terminated(run.info.run_id)
    [meta] = (tmp_path / "mlruns").glob(f"*/{run.info.run_id}/meta.yaml")
    return meta.parent


def test_a_metric_line_cut_to_two_fields_is_left_out_not_read_as_a_resume_at_step_0(tmp_path):
    folder = _run(tmp_path)
    cut = folder / "metrics" / CUT
    text = cut.read_text()
    assert text.endswith(" 9\n")
    cut.write_text(text[:-len(" 9\n")])  # the step field and newline never written
    warned: list[str] = []
    ml = mlflow_run(folder)
    assert ml is not None
    run, _, _ = load_mlflow(ml, warned.append)
    assert run.later_attempt is None  # old: read as a resume at step 0
    assert run.steps == list(STEPS)  # old: [0, 9]
    amax = run.values[("blocks.0.fc", "activation", "amax")]
    assert [amax[s] for s in STEPS[:3]] == [AMAX[s] for s in STEPS[:3]]  # old: step 0 = 4.875
    assert run.values[("blocks.1.fc", "activation", "underflow_pct")][9] == 0.5 + 9
    [said] = warned
    assert "1 MLflow metric file(s) end mid-line" in said and str(cut) in said


def test_an_empty_metric_file_is_one_line_naming_it_not_a_traceback(tmp_path, capsys):
    folder = _run(tmp_path)
    (folder / "metrics" / CUT).write_bytes(b"")  # created, killed before the first line
    assert main(["report", str(folder), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith(f"error: {folder}: MLflow: Metric '{CUT}' is malformed")
    assert str(folder / "metrics" / CUT) in line and "Traceback" not in captured.err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_among_the_metric_files_is_one_line_not_a_hang(tmp_path, capsys):
    """MLflow's client opens every metric file to read the run: at a FIFO it waited forever."""
    folder = _run(tmp_path)
    fifo = folder / "metrics" / CUT
    fifo.unlink()
    os.mkfifo(fifo)
    done: list[int] = []
    report = threading.Thread(daemon=True, target=lambda: done.append(
        main(["report", str(folder), "--out", str(tmp_path / "out")])))
    report.start()
    report.join(120)  # a hang guard, no timing assert
    assert done == [2]
    [line] = capsys.readouterr().err.splitlines()
    assert line == (f"error: {folder}: {fifo}: neither a file nor a folder, where MLflow keeps a "
                    "metric, param or tag in a file (MLflow's client would wait on it forever)")
