"""`foundry-fp8 report` of run folders damaged in three ways a user meets, each read back at the
real sink (the CLI's stderr and exit status): a W&B run file whose header is damaged, an MLflow
run folder copied without its meta.yaml, a run whose loss series is absent. The old report said
"metrics.jsonl: not found (was the `jsonl` logger in the YAML?)" of the first two (or read the
`.wandb` file, given itself, as a JSON Lines file), and nothing of the third."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundry_fp8.cli import main
from foundry_fp8.health.keys import LOSS
from foundry_fp8.jsonl import JsonlSink
from tests.wandb_runs import write_wandb_run

STEPS = (0, 3, 6, 9)


def _series(step: int) -> dict[str, float]:
    """fp8_stats' per-layer series of two healthy layers at `step`."""
    return {f"fp8_{stat}/activation/blocks.{b}.fc": value for b in (0, 1)
            for stat, value in (("underflow_pct", 0.1 * b), ("cos_sim", 0.9995),
                                ("amax", 1.0 + step))}


def _wandb_run(path: Path) -> None:
    """A finished offline run as W&B's own writer writes one: history rows, the exit record."""
    write_wandb_run(path, STEPS, lambda step: {**_series(step), LOSS: 3.0})


def _report(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["report", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("damage", ["cut", "zeros"])
def test_a_wandb_file_with_a_damaged_header_is_named_damaged(tmp_path, capsys, damage):
    """Cut to 3 bytes, or its header overwritten with zeros: W&B's reader reads none of it."""
    pytest.importorskip("wandb")
    folder = tmp_path / "run" / "wandb"
    path = folder / "offline-run-20261130_010000-abc" / "run-abc.wandb"
    _wandb_run(path)
    data = path.read_bytes()
    assert _report([str(folder), "--out", str(tmp_path / "ok")], capsys)[0] == 0  # as written
    if damage == "cut":
        path.write_bytes(data[:3])
        said = "3 byte(s), cut short inside W&B's 7-byte header: damaged (a copy that stopped, a full disk)"
    else:
        path.write_bytes(b"\0" * 7 + data[7:])
        said = ("damaged header: its first 7 bytes are 00 00 00 00 00 00 00, not W&B's "
                "3a 57 26 42 e1 be 00 (`:W&B`, magic number, version)")
    line = f"error: {path}: {said}; W&B's own reader (`wandb sync` too) reads none of it\n"
    for given in (folder, path.parent, path):  # W&B's folder, the attempt's, the file itself
        assert _report([str(given), "--out", str(tmp_path / "out")], capsys) == (2, line), given


def test_an_attempt_with_a_damaged_header_is_said_and_the_others_reported(tmp_path, capsys):
    """A resumed run's first attempt unreadable: one warning, the later attempt's report."""
    pytest.importorskip("wandb")
    folder = tmp_path / "wandb"
    first = folder / "offline-run-20261130_010000-abc" / "run-abc.wandb"
    _wandb_run(first)
    _wandb_run(folder / "offline-run-20261130_020000-abc" / "run-abc.wandb")
    first.write_bytes(first.read_bytes()[:3])
    code, err = _report([str(folder), "--out", str(tmp_path / "out")], capsys)
    assert code == 0
    assert [line for line in err.splitlines() if str(first) in line] == [
        f"warning: {first}: 3 byte(s), cut short inside W&B's 7-byte header: damaged (a copy that "
        "stopped, a full disk); W&B's own reader (`wandb sync` too) reads none of it; the report "
        "covers the other attempts"]


def _mlflow_run(store: Path) -> Path:
    """A file-store run of fp8_stats' series and the loss at STEPS, with MLflow's own client;
    its folder."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.as_uri())
    run = client.create_run(client.create_experiment("fp8"))
    for step in STEPS:
        client.log_batch(run.info.run_id, metrics=[
            Metric(key, value, 1000 + step, step)
            for key, value in {**_series(step), LOSS: 3.0 - 0.1 * step}.items()])
    client.set_terminated(run.info.run_id)
    [meta] = store.glob(f"*/{run.info.run_id}/meta.yaml")
    return meta.parent


def test_an_mlflow_run_folder_without_meta_yaml_is_named_so(tmp_path, capsys):
    pytest.importorskip("mlflow")
    folder = _mlflow_run(tmp_path / "mlruns")
    (folder / "meta.yaml").unlink()  # copied without it
    said = ("an MLflow run folder (metrics/, tags/) without its meta.yaml, which MLflow's client "
            "needs to read the run (copied without it?): copy the run's meta.yaml back into it\n")
    assert _report([str(folder)], capsys) == (2, f"error: {folder}: {said}")
    experiment = folder.parent
    assert _report([str(experiment)], capsys) == (2, f"error: {experiment}: {folder}: {said}")


def _jsonl_run(folder: Path, loss: bool) -> Path:
    sink = JsonlSink(folder / "metrics.jsonl")
    for step in STEPS:
        sink.write(step, {**_series(step), **({LOSS: 3.0 - 0.1 * step} if loss else {})})
    return folder


@pytest.mark.parametrize("sink", ["jsonl", "mlflow"])
def test_a_run_without_its_loss_series_says_so_once(tmp_path, capsys, sink):
    """No Loss line in the report, and no line saying why, read as "no loss spike"."""
    if sink == "mlflow":
        pytest.importorskip("mlflow")
        whole = _mlflow_run(tmp_path / "mlruns")
        lost = _mlflow_run(tmp_path / "lost" / "mlruns")
        (lost / "metrics" / LOSS).unlink()  # the loss's metric file lost
    else:
        whole = _jsonl_run(tmp_path / "whole", loss=True)
        lost = _jsonl_run(tmp_path / "lost", loss=False)
    said = (f"warning: {lost}: no `{LOSS}` logged (Composer's training loss): the report has no "
            "Loss line, no loss spike looked for")
    code, err = _report([str(whole), "--out", str(tmp_path / "o1")], capsys)
    assert code == 0 and LOSS not in err
    assert "Loss: no spike" in (tmp_path / "o1" / "fp8_report.md").read_text()
    code, err = _report([str(lost), "--out", str(tmp_path / "o2")], capsys)
    assert code == 0 and [line for line in err.splitlines() if LOSS in line] == [said]
    assert "Loss: no spike" not in (tmp_path / "o2" / "fp8_report.md").read_text()


def test_a_baseline_with_a_damaged_header_is_named_damaged(tmp_path, capsys):
    """`--baseline` a W&B run whose header is zeroed: the same line as reporting it, naming the
    damage (it said only that W&B's reader cannot read it)."""
    pytest.importorskip("wandb")
    run, base = (tmp_path / name / "wandb" / "offline-run-20261130_010000-abc" / "run-abc.wandb"
                 for name in ("run", "bf16"))
    _wandb_run(run)
    _wandb_run(base)
    base.write_bytes(b"\0" * 7 + base.read_bytes()[7:])
    code, err = _report([str(run.parent), "--baseline", str(base.parent),
                         "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert err == (f"error: --baseline {base}: damaged header: its first 7 bytes are 00 00 00 00 00 00 00, "
                   "not W&B's 3a 57 26 42 e1 be 00 (`:W&B`, magic number, version); W&B's own "
                   "reader (`wandb sync` too) reads none of it\n")
