"""`foundry-fp8 report` given what a user finds in a run folder instead of its metrics.jsonl: a
checkpoint or W&B's binary run file is named as such (by its first bytes) with the run folder
above that holds the metrics, in one line and exit 2."""

from __future__ import annotations

import os

import pytest
import torch
from wandb.sdk.internal.datastore import DataStore

from foundry_fp8.cli import main
from tests.test_report import write_run


def wandb_run_file(path):
    """A run file as W&B's own writer starts one (its header, no record needed)."""
    store = DataStore()
    store.open_for_write(str(path))
    store.close()
    return path


@pytest.mark.parametrize(("make", "said"), [
    (lambda run: wandb_run_file(run / "wandb" / "offline-run-1" / "run-1.wandb"),
     "W&B's binary run file"),
    (lambda run: torch.save({"state": {}}, run / "checkpoints" / "ep0-ba2-rank0.pt")
     or run / "checkpoints" / "ep0-ba2-rank0.pt", "a zip archive (a checkpoint?)"),
])
def test_a_file_of_the_run_folder_names_the_run_folder(tmp_path, capsys, monkeypatch, make, said):
    """QA s15: the `.wandb` file was 'line 4: not a metrics record (a JSON int ...)', and a
    checkpoint in `<run>/checkpoints` did not say where the run's metrics.jsonl was."""
    run = write_run(tmp_path / "run")
    for sub in ("wandb/offline-run-1", "checkpoints"):
        (run / sub).mkdir(parents=True)
    given = make(run)
    monkeypatch.chdir(tmp_path)
    assert main(["report", os.path.relpath(given, tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and said in err, err
    assert err.endswith("; the run's is in run: foundry-fp8 report run"), err


@pytest.mark.parametrize("how", ["run", "baseline"])
def test_a_ctrl_c_inside_w_and_bs_reader_stops_the_report(tmp_path, monkeypatch, capsys, how):
    """QA 19: a Ctrl-C while W&B's reader imports an extension module reaches Python as
    ImportError("initialization failed") from the KeyboardInterrupt (pybind11's module init);
    the report's broad `except` around the reader made it a run W&B "cannot read" and went on.
    A Ctrl-C ends a command with 128 + SIGINT, as a shell reports it."""
    import signal

    import foundry_fp8.wandb_history as wandb_history

    wandb_run = tmp_path / "wb"
    (wandb_run / "wandb" / "offline-run-1").mkdir(parents=True)
    wandb_run_file(wandb_run / "wandb" / "offline-run-1" / "run-1.wandb")

    def interrupted(*_):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise ImportError("initialization failed") from e

    args = {"run": [str(wandb_run)],
            "baseline": [str(write_run(tmp_path / "fp8")), "--baseline", str(wandb_run)]}[how]
    monkeypatch.setattr(wandb_history, "scan", interrupted)
    assert main(["report", *args]) == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().endswith("interrupted")
