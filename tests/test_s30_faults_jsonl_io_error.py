"""A network file system's outage under the run folder mid-run (a Lustre client evicted gives
EIO, an NFS server restarting ESTALE or ETIMEDOUT), met by the `jsonl` logger: each record opens
the file again, so the next write after the outage works. Before, the first failed write stopped
the logger for good, as for a folder in the file's place: one warning, then nothing for the rest
of the run, and `foundry-fp8 report` showed a run that ended at the outage's step. Now the
records are held and written once the file system answers again, as for a full disk
(`tests/test_faults27_jsonl_full_disk.py`)."""

from __future__ import annotations

import errno
import logging
import os
import pathlib
from pathlib import Path
from typing import Any

import pytest
from composer.core import Callback

from foundry_fp8.composer import jsonl_logger
from foundry_fp8.jsonl import read_jsonl
from tests.test_jsonl import _train, _warnings


@pytest.fixture
def outage(monkeypatch):
    """`outage["errno"] = E`: every file opened to write under the run folder fails with E."""
    state: dict[str, int | None] = {"errno": None}
    real_open = pathlib.Path.open

    def open_(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if state["errno"] is not None and any(c in mode for c in "awx"):
            raise OSError(state["errno"], os.strerror(state["errno"]), str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_)
    # tried at each record, as a full disk is (the pause between tries of a failing disk:
    # tests/test_s30_lead_jsonl_outage_retry.py)
    monkeypatch.setattr(jsonl_logger, "OUTAGE_RETRY_S", 0.0)
    return state


class _Outage(Callback):
    def __init__(self, outage: dict, code: int, start: int, end: int | None):
        self.outage, self.code, self.start, self.end = outage, code, start, end

    def batch_start(self, state, logger):
        batch = int(state.timestamp.batch)
        if batch == self.start:
            self.outage["errno"] = self.code
        if batch == self.end:
            self.outage["errno"] = None


def _losses(path: Path) -> dict[int, float]:
    return {s: m["loss/train/total"] for s, m in read_jsonl(path) if "loss/train/total" in m}


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE, errno.ETIMEDOUT])
def test_the_records_of_an_outage_are_written_once_it_ends(tmp_path, caplog, outage, code):
    _train(tmp_path / "ref", jsonl_logger.JSONLLogger(path=str(tmp_path / "ref" / "m.jsonl")),
           batches=10)
    path = tmp_path / "r" / "metrics.jsonl"
    with caplog.at_level(logging.WARNING, logger="foundry_fp8"):
        _train(tmp_path, jsonl_logger.JSONLLogger(path=str(path)),
               [_Outage(outage, code, 3, 7)], batches=10)
    assert _losses(path) == _losses(tmp_path / "ref" / "m.jsonl")
    assert sorted(_losses(path)) == list(range(10))
    said = [w for w in _warnings(caplog) if w.startswith("jsonl logger")]
    assert len(said) == 2, said
    kind = type(OSError(code, "")).__name__  # ETIMEDOUT: TimeoutError
    assert said[0].startswith(f"jsonl logger: cannot write {path} ({kind}: "
                              f"{os.strerror(code)}); the records from here on are held")
    assert said[1].startswith(f"jsonl logger: {path} is written again after its write errors: "
                              "the "), said[1]
    assert said[1].endswith(" records held (steps 3 to 6) are in it"), said[1]


def test_an_outage_until_close_says_what_never_reached_the_disk(tmp_path, caplog, outage):
    path = tmp_path / "r" / "metrics.jsonl"
    with caplog.at_level(logging.WARNING, logger="foundry_fp8"):
        trainer = _train(tmp_path, jsonl_logger.JSONLLogger(path=str(path)),
                         [_Outage(outage, errno.EIO, 3, None)], batches=6)
        trainer.close()
    said = [w for w in _warnings(caplog) if w.startswith("jsonl logger")]
    assert said[-1].startswith("jsonl logger: ") and said[-1].endswith(
        " never reached the disk, which was failing: the Trainer closed with the disk still "
        "failing")
    assert sorted(_losses(path)) == [0, 1, 2]
