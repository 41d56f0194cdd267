"""A logger destination that failed is warned about once and not kept after its run: a sweep or
notebook whose MLflow server is down made one failing MLflowLogger per run, each held by the
warned-once record for the rest of the process."""

from __future__ import annotations

import gc
import logging
import weakref

from composer.loggers import LoggerDestination

from foundry_fp8.composer.destinations import deliver


class _Down(LoggerDestination):
    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        raise RuntimeError("logging server down")


def _send(destination: LoggerDestination) -> None:
    deliver([destination], "metrics", lambda d: d.log_metrics({"x": 1.0}), "fp8_stats")


def test_a_failing_destination_is_warned_once_per_run(caplog):
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.destinations"):
        for run in range(2):
            down = _Down()
            for _ in range(3):
                _send(down)
            assert len(caplog.messages) == run + 1
    assert all("_Down failed to log metrics" in m for m in caplog.messages)


def test_a_failing_destination_is_not_kept_after_its_run():
    # no log record: pytest keeps each one, whose traceback holds the logger
    before = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        down = _Down()
        _send(down)
    finally:
        logging.disable(before)
    kept = weakref.ref(down)
    del down
    gc.collect()
    assert kept() is None, "the warned-once record keeps the failed logger alive"
