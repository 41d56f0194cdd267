"""A disk that stays full for the rest of a long run (a multi-day job whose checkpoints filled
it). The `jsonl` logger holds records up to `HELD_BYTES` and counts the rest; before, it kept
the step of every record past the cap in a list, so its memory grew by one entry per record for
as long as the disk stayed full (8 bytes or more each; the CPU try's MPT with fp8_stats at
interval 1 and fp8_guard logs 13 records a batch: 10 MB or more per 100k batches), in the one
case the cap was there for. Now it keeps a count and the first and last step, and says the
same."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

from foundry_fp8.composer import jsonl_logger
from foundry_fp8.jsonl import read_jsonl
from tests.test_faults27_jsonl_full_disk import _toggling, disk  # noqa: F401 (the fixture)
from tests.test_jsonl import _train, _warnings

FULL_AT = 2


def _entries(value: Any, seen: set[int]) -> Iterator[int]:
    """The entries of every list, tuple, deque, set and dict reachable from `value` through
    containers: what a logger keeps, beyond its fixed fields."""
    if id(value) in seen or not isinstance(value, list | tuple | deque | set | frozenset | dict):
        return
    seen.add(id(value))
    yield len(value)
    for item in value.items() if isinstance(value, dict) else value:
        yield from _entries(item, seen)


def _kept(logger: jsonl_logger.JSONLLogger) -> int:
    seen: set[int] = set()
    return sum(sum(_entries(value, seen)) for value in vars(logger).values())


def _full_run(tmp_path, disk, batches: int, caplog) -> tuple[int, list[str]]:  # noqa: F811
    """Train `batches` on a disk full from FULL_AT on; what the logger keeps before its close,
    and what it said."""
    path = tmp_path / f"b{batches}" / "metrics.jsonl"
    logger = jsonl_logger.JSONLLogger(path=str(path))
    with caplog.at_level(logging.WARNING, logger="foundry_fp8"):
        trainer = _train(tmp_path, logger, [_toggling(disk, FULL_AT, None)], batches=batches)
        kept = _kept(logger)
        trainer.close()
    disk["full"] = False
    return kept, [w for w in _warnings(caplog) if w.startswith("jsonl logger")]


def test_what_a_full_disk_costs_in_memory_does_not_grow_with_the_batches(
        tmp_path, caplog, disk, monkeypatch):  # noqa: F811
    monkeypatch.setattr(jsonl_logger, "HELD_BYTES", 0)  # every record past the cap
    # the records each batch logs, from a run whose disk stays free
    free = tmp_path / "free" / "metrics.jsonl"
    _train(tmp_path, jsonl_logger.JSONLLogger(path=str(free)), batches=16).close()
    records = [step for step, _ in read_jsonl(free)]
    short, said_short = _full_run(tmp_path, disk, 8, caplog)
    caplog.clear()
    long, said = _full_run(tmp_path, disk, 16, caplog)
    assert long == short, (short, long)
    # still says how many records never reached the disk, and of which steps
    lost = sum(step >= FULL_AT for step in records)
    assert lost > 16 * 2, records
    assert said[-1].startswith(f"jsonl logger: {lost} records of steps {FULL_AT} to 16 and the "
                               "latest hparams.json never reached the disk"), said
    assert said_short[-1].startswith("jsonl logger: "), said_short
