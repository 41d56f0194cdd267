"""A tensor logged while the `jsonl` logger holds its records (a full disk, a network file
system's outage). The held record kept the tensor itself: written later, it showed the numbers
the tensor had then (a caller that updates it in place, as an accumulator does), and it was
counted against HELD_BYTES by its str(), which shows six of its numbers: a 10,000-element
tensor logged at each step weighed ~100 bytes, not ~100 kB, so the 16 MiB bound held ~1000x
more (on the GPU, for a CUDA tensor)."""

from __future__ import annotations

import errno
import os
import pathlib
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback

from foundry_fp8.composer import jsonl_logger
from foundry_fp8.jsonl import read_jsonl
from tests.test_jsonl import _train


class _Accumulator(Callback):
    """Logs a running sum (a tensor it adds to in place after logging) and fills the disk from
    batch 2 to 5, as ENOSPC at open."""

    def __init__(self, disk: dict[str, bool], size: int):
        self.disk, self.total = disk, torch.zeros(size)
        self.held_bytes: list[int] = []

    def batch_start(self, state: Any, logger: Any) -> None:
        self.disk["full"] = 2 <= int(state.timestamp.batch) < 5

    def batch_end(self, state: Any, logger: Any) -> None:
        logger.log_metrics({"sum": self.total})
        self.total += 1
        destination = next(d for d in logger.destinations
                           if isinstance(d, jsonl_logger.JSONLLogger))
        self.held_bytes.append(destination._held_bytes)


def test_a_held_tensor_is_written_as_it_was_logged_and_weighed_whole(tmp_path, monkeypatch):
    disk = {"full": False}
    real_open = pathlib.Path.open

    def open_(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if disk["full"] and any(c in mode for c in "awx"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", open_)
    path = tmp_path / "r" / "metrics.jsonl"
    callback = _Accumulator(disk, 10_000)
    _train(tmp_path, jsonl_logger.JSONLLogger(path=str(path)), [callback], batches=7)
    sums = {s: m["sum"] for s, m in read_jsonl(path) if "sum" in m}
    # batch_end of batch b logs at step b + 1 the sum b (added to after it is logged)
    assert {s: (v[0], v[-1]) for s, v in sums.items()} == {s: (s - 1.0, s - 1.0)
                                                           for s in range(1, 8)}
    # batches 2, 3, 4 held: each record weighs at least its 10,000 numbers ("2.0, " each)
    assert callback.held_bytes[4] >= 3 * 10_000 * len("2.0, ")
