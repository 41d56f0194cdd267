"""`fp8_stats`: the Composer callback over FP8Monitor (`callbacks: {fp8_stats: {...}}`)."""

from __future__ import annotations

import logging

from composer.core import Callback, Event, State, Time, TimeUnit
from composer.loggers import Logger

from foundry_fp8.monitor import FP8Monitor, MonitorConfig

log = logging.getLogger(__name__)


def _batches(interval: int | str) -> int:
    """`100` or `"100ba"` -> 100; only batch intervals make sense for per-step stats."""
    if isinstance(interval, int):
        value = interval
    else:
        time = Time.from_timestring(str(interval))
        if time.unit != TimeUnit.BATCH:
            raise ValueError(f"fp8_stats.interval: use batches such as '100ba', got {interval!r}")
        value = time.value
    if value < 1:
        raise ValueError(f"fp8_stats.interval: must be at least 1 batch, got {interval!r}")
    return value


class FP8Stats(Callback):
    """Logs `fp8/<layer>/<tensor>/<stat>` every `interval` batches between `start` and `end`.

    Our own errors never stop training: the callback logs the error and switches itself off,
    unless `strict: true`.
    """

    def __init__(self, interval: int | str = "100ba", start: int = 0, end: int | None = None,
                 layers: str = ".*", exclude: str | None = None,
                 tensors: list[str] | tuple[str, ...] = ("activation", "weight", "gradient"),
                 max_underflow_pct: float = 5.0, max_overflow_pct: float = 0.0,
                 min_cos_sim: float = 0.99, strict: bool = False):
        self.interval = _batches(interval)
        self.start, self.end, self.strict = start, end, strict
        self.config = MonitorConfig(include=layers, exclude=exclude, tensors=tuple(tensors),
                                    max_underflow_pct=max_underflow_pct,
                                    max_overflow_pct=max_overflow_pct, min_cos_sim=min_cos_sim)
        self.monitor: FP8Monitor | None = None
        self.disabled = False

    def _due(self, batch: int) -> bool:
        in_window = batch >= self.start and (self.end is None or batch < self.end)
        return in_window and batch % self.interval == 0

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        if self.disabled:
            return
        try:
            self._run_event(event, state, logger)
        except Exception:
            if self.strict:
                raise
            log.exception("fp8_stats failed; disabling it for the rest of the run "
                          "(set strict: true to fail instead)")
            if self.monitor is not None:
                self.monitor.finish_step()
            self.disabled = True

    def _run_event(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.FIT_START:
            self.monitor = FP8Monitor(state.model, self.config, on_warning=log.warning)
            log.info("fp8_stats watches %d layers", len(self.monitor.layers))
        elif event == Event.BATCH_START and self.monitor is not None:
            if self._due(int(state.timestamp.batch)):
                self.monitor.start_step()
        elif event == Event.BATCH_END and self.monitor is not None and self.monitor.active:
            # timestamp already counts this batch; log at the step it describes
            metrics = self.monitor.finish_step()
            logger.log_metrics(metrics, step=int(state.timestamp.batch) - 1)
