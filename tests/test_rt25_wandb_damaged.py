"""`foundry-fp8 report` of a W&B run file damaged mid-way (a bad disk block, a copy gone wrong):
W&B's own reader stops at the damaged block, as `wandb sync` does. The old report called a
finished run "still being written (or was killed)"; it now says where the file is damaged."""

from __future__ import annotations

from pathlib import Path

from foundry_fp8 import wandb_history
from foundry_fp8.cli import main
from tests.wandb_runs import write_wandb_run

STEPS = range(0, 2000, 2)  # about 150 kB: blocks of 32 KiB follow the damaged one


def _finished_run(path: Path) -> None:
    """A finished offline run as W&B's own writer writes one: history rows, the exit record."""
    write_wandb_run(path, STEPS, lambda step: {"fp8_underflow_pct/weight/blocks.0.fc": 0.01 * step,
                                               "fp8_amax/weight/blocks.0.fc": 1.0 + step})


def test_a_run_file_damaged_mid_way_is_said_damaged_not_still_written(tmp_path, capsys):
    path = tmp_path / "wandb" / "offline-run-20261130_010000-abc" / "run-abc.wandb"
    _finished_run(path)
    assert wandb_history.read_run(path).complete
    data = bytearray(path.read_bytes())
    data[20_000:20_040] = b"\xff" * 40  # in the first block's records
    path.write_bytes(bytes(data))
    read = wandb_history.read_run(path)
    assert not read.complete and read.damaged_at is not None and read.damaged_at < 32768
    rows = len(read.rows)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    [said] = [line for line in capsys.readouterr().err.splitlines() if str(path) in line]
    assert said == (f"warning: {path}: damaged at byte {read.damaged_at} of {len(data)}, with "
                    "more written after it: W&B's own reader (`wandb sync` too) stops there; "
                    f"{rows} history row(s) read, up to step {STEPS[rows - 1]}; the report "
                    f"covers what was read, up to step {STEPS[rows - 1]}")


def test_a_run_file_cut_short_by_a_kill_is_not_said_damaged(tmp_path):
    path = tmp_path / "run-abc.wandb"
    _finished_run(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    path.with_name("zeros.wandb").write_bytes(data[: len(data) // 2] + b"\0" * 40_000)
    for cut in (path, path.with_name("zeros.wandb")):  # a kill; a power cut's zeros
        read = wandb_history.read_run(cut)
        assert not read.complete and read.damaged_at is None and read.rows
