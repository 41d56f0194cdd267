"""`fp8_stats`: the Composer callback over FP8Monitor (`callbacks: {fp8_stats: {...}}`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from foundry_fp8.fp8_meta import canonical_modules
from foundry_fp8.health.keys import parse_key
from foundry_fp8.monitor import FP8Monitor, FP8MonitorError, multi_rank
from foundry_fp8.options import MonitorConfig, Schedule, build
from foundry_fp8.paths import in_run_folder
from foundry_fp8.te.debug import TEDebugSession, layer_pattern, log_fp8_tensor_stats_config

log = logging.getLogger(__name__)


def _is_rank_zero() -> bool:
    return dist.get_global_rank() == 0


def run_folder(state: State, logger: Logger) -> Path:
    """Where this run writes: the `jsonl` logger's folder (what `foundry-fp8 report` reads),
    else the run folder (`foundry_fp8.paths`: the parent of a local checkpoint `save_folder`,
    else `runs/<run_name>`)."""
    from foundry_fp8.composer.jsonl_logger import JSONLLogger, state_run_folder

    for destination in logger.destinations:
        if isinstance(destination, JSONLLogger) and destination.sink is not None:
            return destination.sink.path.parent
    return state_run_folder(state)


class FP8Stats(Callback):
    """Logs `fp8/<layer>/<tensor>/<stat>` every `interval` batches between `start` and `end`
    (and at `dump_steps`, where it also saves the tensors), pooled over ranks and logged by
    rank 0; prints the worst value per layer and tensor at fit end.

    Our own errors never stop training: the callback logs the error and switches itself off,
    unless `strict: true`. Under several ranks every rank switches off together, so that none
    is left waiting in a collective: a rank that fails logs its error and stays in step (joining
    the collectives with no statistics of its own) until the next logging step, whose all_reduce
    carries its failure flag and switches fp8_stats off on every rank (see FP8Monitor.fail); a
    failure to start at FIT_START is agreed on by one all_reduce there. `strict: true` raises on
    the failing rank instead: the job then dies, the other ranks being ended by the launcher.
    """

    def __init__(self, **options: Any):
        self.options = build("fp8_stats", options)  # one line naming callbacks.fp8_stats.<key>
        self.schedule: Schedule = self.options.schedule
        self.config: MonitorConfig = self.options.monitor
        self.dump_folder: str | None = self.options.dump_folder
        self.strict: bool = self.options.strict
        self.monitor: FP8Monitor | None = None
        self.disabled = False
        self._step = 0
        self._te_metrics: dict[str, float] = {}
        #: Called on every rank at each logging step with (step, table, flags): the pooled
        #: `{(layer, tensor): {stat: value}}` and the health flags raised (fp8_guard's input).
        self.listeners: list[Callable[[int, dict, dict], None]] = []
        self.te_debug = _start_te_debug(self.options.te_debug, self.config.layers,
                                        self.config.exclude, self.config.tensors, self.schedule,
                                        Path(self.options.te_debug_folder),
                                        self._te_metrics.__setitem__)

    # Composer's named events; each runs under `_guarded` (our error never stops training).

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.disabled:
            return
        self._guarded(self._fit_start, state, logger)
        if multi_rank():
            # once per fit: a rank that could not build its monitor cannot join the steps'
            # collectives, so the ranks agree here on whether one failed
            failed = state.device.tensor_to_device(torch.tensor([float(self.disabled)]))
            dist.all_reduce(failed, reduce_operation="MAX")
            if failed.item() and not self.disabled:
                log.error("fp8_stats failed to start on another rank; disabling it here too")
                self.disabled = True

    def batch_start(self, state: State, logger: Logger) -> None:
        self._guarded(self._batch_start, state, logger)

    def after_train_batch(self, state: State, logger: Logger) -> None:
        self._guarded(self._after_train_batch, state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._guarded(self._fit_end, state, logger)

    def _guarded(self, work: Callable[[State, Logger], None], state: State,
                 logger: Logger) -> None:
        if self.disabled:
            return
        try:
            work(state, logger)
        except Exception as e:
            if self.strict:
                raise
            self._failed(e)

    def _failed(self, error: Exception) -> None:
        """Switch off now where every rank agrees (an FP8MonitorError, raised on every rank
        together; a single process; no monitor yet); else stay in step (see the class doc)."""
        if self.monitor is not None and multi_rank() and not isinstance(error, FP8MonitorError):
            log.exception("fp8_stats failed on this rank; every rank switches it off at the next "
                          "logging step (set strict: true to fail instead)")
            self.monitor.fail(error)
            return
        log.exception("fp8_stats failed; disabling it for the rest of the run "
                      "(set strict: true to fail instead)")
        if self.monitor is not None:
            self.monitor.abort()
        self.disabled = True

    def _fit_start(self, state: State, logger: Logger) -> None:
        self.monitor = None  # until built: a rank that fails here cannot join collectives
        config = self.config
        if self.schedule.dump_steps:
            folder = in_run_folder(self.dump_folder or "fp8_dumps", run_folder(state, logger),
                                   state.run_name, "callbacks.fp8_stats.dump_folder")
            config = dataclasses.replace(config, dump_folder=folder)
        self.monitor = FP8Monitor(state.model, config, schedule=self.schedule,
                                  on_warning=log.warning if _is_rank_zero() else lambda _: None)
        log.info("fp8_stats watches %d layers", len(self.monitor.layers))
        if self.te_debug is not None:
            self.te_debug.name_layers(canonical_modules(state.model))

    def _batch_start(self, state: State, logger: Logger) -> None:
        if self.monitor is not None:
            self._step = int(state.timestamp.batch)
            self.monitor.start_step(self._step)

    def _after_train_batch(self, state: State, logger: Logger) -> None:
        """The batch's forward and backward are done (every micro-batch) and Composer has not
        yet logged its loss: logged now at the batch's own step, the step of its
        `loss/train/total`, they land in W&B. At BATCH_END other callbacks have already logged
        at the next step, and W&B drops a step lower than one it has seen."""
        if self.monitor is None:
            return
        metrics = self.monitor.finish_step()  # raises only on every rank together
        if metrics and self.listeners:
            table = stats_table(metrics)
            for listener in self.listeners:
                listener(self._step, table, {})
        if self.te_debug is not None:
            self.te_debug.step()  # TE logs the finished step's stats into _te_metrics
            metrics.update(self._te_metrics)
            self._te_metrics.clear()
        if metrics and _is_rank_zero():
            self._rank_zero(lambda: logger.log_metrics(metrics, step=self._step),
                            "logging the metrics")

    def _fit_end(self, state: State, logger: Logger) -> None:
        if self.monitor is None:
            return
        if self.te_debug is not None:
            self.te_debug.close()
        summary = self.monitor.summary()
        if summary and _is_rank_zero():
            print(f"foundry_fp8 fp8_stats: worst value per layer and tensor\n{summary}",
                  flush=True)
            self._rank_zero(lambda: logger.log_hyperparameters(
                {"fp8/stats_summary": summary}), "logging the summary")

    def _rank_zero(self, call: Callable[[], None], what: str) -> None:
        """What rank 0 alone does (logging): a failure of the logger is logged and the
        statistics go on; `strict: true` raises."""
        try:
            call()
        except Exception:
            if self.strict:
                raise
            log.exception("fp8_stats: %s failed on rank 0; the statistics go on", what)


def stats_table(metrics: Mapping[str, float]) -> dict[tuple[str, str], dict[str, float]]:
    """`{(layer, tensor): {stat: value}}` from the monitor's per-layer metrics (the health key
    layout, or the older `fp8/<layer>/<tensor>/<stat>`); other keys are left out."""
    table: dict[tuple[str, str], dict[str, float]] = {}
    for key, value in metrics.items():
        parsed = parse_key(key)
        if parsed is None and key.startswith("fp8/") and key.count("/") >= 3:
            layer, tensor, stat = key.removeprefix("fp8/").rsplit("/", 2)
            parsed = stat, tensor, layer
        if parsed is not None:
            stat, tensor, layer = parsed
            table.setdefault((layer, tensor), {})[stat] = value
    return table


def _start_te_debug(scaling: str | None, layers: str, exclude: str | None,
                    tensors: Sequence[str], schedule: Schedule, folder: Path,
                    sink: Callable[[str, float], None]) -> TEDebugSession | None:
    """TE's own statistics on the tensors TE casts (`te_debug: delayed|current`, the training
    recipe's scaling, which decides what TE can compute). Started here, in the constructor:
    TE's debug API must exist before the first TE module, and LLM-Foundry builds callbacks
    before the model."""
    if scaling is None:
        return None
    from foundry_fp8.te.probe import te_available

    if not te_available():
        raise RuntimeError("fp8_stats.te_debug: needs TransformerEngine and nvdlfw-inspect "
                           "(pip install 'foundry-fp8[te]' on a GPU machine); without TE, "
                           "leave te_debug unset: the module-hook statistics work anywhere")
    config = log_fp8_tensor_stats_config(layer_pattern(layers, exclude), tensors, schedule.interval, scaling,
                                         start_step=schedule.start, end_step=schedule.end)
    session = TEDebugSession(config, folder, lambda name, value, step: sink(name, value))
    session.start()
    return session
