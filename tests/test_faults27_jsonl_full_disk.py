"""A full disk for a while (a checkpoint being written fills it; uploaded and deleted, it frees
again), met by the `jsonl` logger mid-run. Before, its first failed write stopped it for good:
one warning, then nothing more for the rest of the run, so `foundry-fp8 report` showed a run
that ended at the batch the disk filled (checked on a 256 kB tmpfs filled at batch 2 and freed
at batch 40 of 60: the file ended at step 12). Now the records are held in memory and written,
in order, once the disk takes them again, each event said once; `hparams.json` too.

The full disk is what the OS gives: a buffered append whose bytes are taken (the file's
position moves on) but whose flush at close fails with ENOSPC after half of them reached the
file, and a new file (`hparams.json`'s temporary) whose first write fails."""

from __future__ import annotations

import errno
import json
import logging
import pathlib
from pathlib import Path
from typing import Any

import pytest

from foundry_fp8.composer import jsonl_logger
from foundry_fp8.jsonl import read_jsonl
from tests.test_jsonl import _train, _warnings


class _Full:
    """A file on a full disk: half of what is written reaches it, the rest fails at close."""

    def __init__(self, real: Any):
        self.real, self.owed = real, 0

    def __enter__(self) -> _Full:
        return self

    def __exit__(self, *exc: object) -> None:
        self.real.close()
        raise OSError(errno.ENOSPC, "No space left on device")

    def write(self, data: bytes) -> int:
        if "x" in self.real.mode:  # a new file: the OS refuses its first block
            raise OSError(errno.ENOSPC, "No space left on device")
        self.real.write(data[: len(data) // 2])
        self.owed += len(data) - len(data) // 2
        return len(data)

    def tell(self) -> int:
        return self.real.tell() + self.owed

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture
def disk(monkeypatch):
    """`disk["full"] = True` fills the disk for every file under the run folder."""
    state = {"full": False}
    real_open = pathlib.Path.open

    def open_(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = real_open(self, mode, *args, **kwargs)
        if state["full"] and any(c in mode for c in "awx"):
            return _Full(f)
        return f

    monkeypatch.setattr(pathlib.Path, "open", open_)
    return state


def _toggling(disk: dict, full: int, free: int | None):
    from composer.core import Callback

    class Toggle(Callback):
        def batch_start(self, state, logger):
            batch = int(state.timestamp.batch)
            if batch == full:
                disk["full"] = True
                logger.log_hyperparameters({"during": batch})  # refused, held, written later
            if batch == free:
                disk["full"] = False

    return Toggle()


def test_records_of_a_full_disk_are_written_once_it_frees(tmp_path, caplog, disk):
    reference = _train(tmp_path / "ref", jsonl_logger.JSONLLogger(
        path=str(tmp_path / "ref" / "metrics.jsonl")), batches=10)
    del reference
    path = tmp_path / "r" / "metrics.jsonl"
    with caplog.at_level(logging.WARNING, logger="foundry_fp8"):
        _train(tmp_path, jsonl_logger.JSONLLogger(path=str(path)), [_toggling(disk, 3, 7)],
               batches=10)
    losses = {s: m["loss/train/total"] for s, m in read_jsonl(path) if "loss/train/total" in m}
    expected = {s: m["loss/train/total"] for s, m in read_jsonl(tmp_path / "ref" /
                                                                "metrics.jsonl")
                if "loss/train/total" in m}
    assert losses == expected and sorted(losses) == list(range(10))
    said = [w for w in _warnings(caplog) if w.startswith("jsonl logger")]
    assert len(said) == 2, said
    # the hyperparameter logged as the disk filled was the first write refused
    assert said[0].startswith(f"jsonl logger: cannot write {path.with_name('hparams.json')} "
                              "(OSError: No space left on device); the records from here on are "
                              "held in memory (up to 16 MiB)"), said[0]
    assert said[1].startswith(f"jsonl logger: {path} is written again after a full disk: the ")
    assert said[1].endswith("records held (steps 3 to 6) are in it"), said[1]
    assert json.loads((tmp_path / "r" / "hparams.json").read_text())["during"] == 3


def test_a_disk_still_full_at_close_says_what_never_reached_it(tmp_path, caplog, disk,
                                                                 monkeypatch):
    """Past `HELD_BYTES` the records are counted, not kept; at the Trainer's close one last try,
    then one line naming what is lost. Training is never stopped."""
    monkeypatch.setattr(jsonl_logger, "HELD_BYTES", 200)
    path = tmp_path / "r" / "metrics.jsonl"
    with caplog.at_level(logging.WARNING, logger="foundry_fp8"):
        trainer = _train(tmp_path, jsonl_logger.JSONLLogger(path=str(path)),
                         [_toggling(disk, 3, None)], batches=6)
        assert int(trainer.state.timestamp.batch) == 6
        trainer.close()
    said = [w for w in _warnings(caplog) if w.startswith("jsonl logger")]
    assert len(said) == 2, said
    assert said[1].startswith("jsonl logger: ") and said[1].endswith(
        " never reached the disk, which was full: the Trainer closed with the disk still full")
    assert " records of steps 3 to 6 and the latest hparams.json" in said[1]
    assert max(s for s, m in read_jsonl(path) if "loss/train/total" in m) < 3
