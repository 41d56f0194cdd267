"""The `jsonl` logger in a network file system's outage tries the file again at most every
OUTAGE_RETRY_S seconds, not at each record: an open on a soft-mounted NFS blocks for the mount's
timeout (minutes), and Composer logs several times a batch, so trying at each one (as for a full
disk, which refuses at once) all but stopped training for the whole outage."""

from __future__ import annotations

import errno
import os
import pathlib
from pathlib import Path
from typing import Any

from composer.core import Callback

from foundry_fp8.composer import jsonl_logger
from tests.test_jsonl import _train
from tests.test_s30_faults_jsonl_io_error import _losses


class _Clock(Callback):
    """Batch N starts at N x 10 s; the file system fails from batch 3 to 6."""

    def __init__(self, now: list[float], failing: list[bool]):
        self.now, self.failing = now, failing

    def batch_start(self, state, logger):
        batch = int(state.timestamp.batch)
        self.now[0] = 10.0 * batch
        self.failing[0] = 3 <= batch < 7


def test_a_failing_disk_is_tried_every_30_s_and_written_once_it_answers(tmp_path, monkeypatch):
    now, failing, tries = [0.0], [False], []
    real_open = pathlib.Path.open

    def open_(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "awx") and self.name == "metrics.jsonl":
            tries.append((now[0], failing[0]))
            if failing[0]:
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_)
    monkeypatch.setattr(jsonl_logger, "_now", lambda: now[0])
    path = tmp_path / "r" / "metrics.jsonl"
    _train(tmp_path, jsonl_logger.JSONLLogger(path=str(path)), [_Clock(now, failing)],
           batches=10)
    # the first failure at 30 s, one try 30 s later (60 s, still failing), the next at 90 s
    assert [t for t in tries if t[1]] == [(30.0, True), (60.0, True)]
    assert (70.0, False) not in tries and (80.0, False) not in tries
    assert sorted(_losses(path)) == list(range(10))  # all written at 90 s, before any close
