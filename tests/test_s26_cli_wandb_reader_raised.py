"""`foundry-fp8 report` where W&B's own reader raises on a run file instead of asserting: bytes
after a finished run's last record (IndexError on a record type it has no checksum for), a FIFO
in the run file's place. The old report threw away what was read and said `<run>/metrics.jsonl:
not found (was the `jsonl` logger in the YAML?)`, naming no W&B file; `--baseline` refused the
run. A read-only run file (W&B's reader opens it read-write) is read from a private copy:
tests/test_s26_follow_wandb_readonly.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from wandb.sdk.internal.datastore import DataStore

from foundry_fp8.health import layer_key
from foundry_fp8.report.baseline import read_baseline
from foundry_fp8.report.cli import load
from foundry_fp8.report.read import ReportError
from tests.wandb_runs import write_wandb_run

STEPS = range(0, 20, 2)
LAYER = "blocks.0.fc"


def _finished_run(folder: Path) -> Path:
    """A finished offline run as W&B's own writer leaves it: per-layer FP8 rows, the loss."""
    return write_wandb_run(
        folder / "wandb" / "offline-run-20261130_010000-abc" / "run-abc.wandb", STEPS,
        lambda step: {layer_key("underflow_pct", "weight", LAYER): 0.01 * step,
                      layer_key("amax", "weight", LAYER): 1.0 + step,
                      "loss/train/total": 3.0 - 0.1 * step})


def test_bytes_after_a_finished_runs_last_record_keep_what_w_and_b_read(tmp_path, capsys):
    path = _finished_run(tmp_path / "run")
    with path.open("ab") as f:
        f.write(b"xyz" * 1000)  # a record header of type 122: W&B's reader raises IndexError
    store = DataStore()
    store.open_for_scan(str(path))
    with pytest.raises(IndexError):  # the reader's own failure, which the report meets
        while store.scan_data() is not None:
            pass
    store.close()

    loaded = load(tmp_path / "run")
    assert loaded.run.steps == list(STEPS) and loaded.run.layers == [LAYER]
    [said] = capsys.readouterr().err.splitlines()
    assert said == (f"warning: {path}: W&B's own reader (`wandb sync` too) stops with IndexError: "
                    f"list index out of range after {len(STEPS)} history row(s), up to step "
                    f"{STEPS[-1]}; the report covers what it read")
    assert sorted(read_baseline(tmp_path / "run").losses) == list(STEPS)


def test_a_fifo_in_the_run_files_place_is_named(tmp_path):
    path = tmp_path / "run" / "wandb" / "offline-run-20261130_010000-abc" / "run-abc.wandb"
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    for read in (load, read_baseline):
        with pytest.raises(ReportError) as e:
            read(tmp_path / "run")
        assert str(e.value).endswith(
            f"{path}: W&B's own reader (`wandb sync` too) stops with UnsupportedOperation: File "
            "or stream is not seekable. (a FIFO (named pipe), not a run file), having read no "
            "history row"), e.value
