"""Sending what our callbacks log to each of Composer's logger destinations on its own.

Composer's `Logger.log_metrics` (and `log_hyperparameters`, `log_images`, `log_table`) calls the
destinations one after the other, unguarded: the first that raises (W&B's service gone, a full
disk under MLflow) ends the call, so every destination after it, the `jsonl` logger included,
gets nothing, and the exception reaches the callback, which took it for its own bug and switched
itself off. `deliver` calls each destination in its own `try` instead.

A destination's failure is not our bug: it never switches a callback off. It is warned once per
destination and kind (`metrics`, `hyperparameters`, `images`, `table`), naming the destination's
class and the error, and the other destinations still get the values. `strict: true` (fp8_stats,
fp8_guard) raises the first error, once every destination has been tried.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable

from composer.loggers import ConsoleLogger, LoggerDestination

log = logging.getLogger(__name__)

#: The kinds already warned about, per failing destination, by identity (a destination defined
#: as an `eq=True` dataclass is unhashable). An entry leaves with its destination (its id is
#: then free for another): held, every failing logger of every run in the process was kept.
_warned: dict[int, tuple[weakref.ref[LoggerDestination], set[str]]] = {}


def _warned_kinds(destination: LoggerDestination) -> set[str]:
    key = id(destination)
    if key not in _warned:
        _warned[key] = (weakref.ref(destination, lambda _: _warned.pop(key, None)), set())
    return _warned[key][1]


def deliver(destinations: Iterable[LoggerDestination], kind: str,
            send: Callable[[LoggerDestination], object], who: str, strict: bool = False) -> None:
    """`send(destination)` for every destination, each in its own `try` (module doc); `who`
    names the callback in the warning."""
    first: Exception | None = None
    for destination in destinations:
        try:
            send(destination)
        except Exception as error:
            first = first or error
            _warn(destination, kind, who, error)
    if strict and first is not None:
        raise first


def _warn(destination: LoggerDestination, kind: str, who: str, error: Exception) -> None:
    name = type(destination).__name__
    kinds = _warned_kinds(destination)
    if kind in kinds:
        log.debug("%s: %s failed to log %s again: %r", who, name, kind, error)
        return
    kinds.add(kind)
    # an OSError is the machine's (a full disk, the network, a permission): the line says it
    # all; a traceback, 45 lines of W&B's media copy for a full disk, read as a crash
    log.warning("%s: the logger %s failed to log %s (%s: %s); the other loggers are not "
                "affected and training goes on (warned once per logger and kind)", who, name,
                kind, type(error).__name__, error,
                exc_info=None if isinstance(error, OSError) else error)
    if isinstance(error, OSError):  # its traceback for a user who asks (debug logging)
        log.debug("%s: where %s failed to log %s", who, name, kind, exc_info=error)


class ConsoleResend:
    """Series logged every few batches that an evaluation kept off the console, given to it
    again.

    Composer's ConsoleLogger prints what was logged since its last print every
    `console_log_interval`, and its `eval_start` drops what it has not printed yet
    (composer/loggers/console_logger.py, `eval_start` and `batch_end`, 0.31 and 0.32.1): a
    logging step of ours between two console prints with an evaluation in between never reached
    the console (loss, logged at every batch, comes back at the next one; ours do not).
    `sent` notes what a callback gave each console; `resend`, at the events before which the
    console may print next (BATCH_START, EPOCH_END, FIT_END: Composer runs the other callbacks'
    events before the loggers', core/engine.py `run_event`), logs it again where the console has
    printed nothing since its step (its `last_logged_batch`, the batch count of its last print,
    is not past it). Logging again what the console still holds changes nothing.

    Our own error in `resend` or `fit_end` costs the callback only these console lines: it is
    said once, naming the callback, and no more is resent (`strict` raises it). A logger's own
    failure is `deliver`'s, raised only under `strict`."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[ConsoleLogger, int, dict[str, float]]] = {}
        self._broken = False  # our own error resending: said once, nothing resent since

    def sent(self, destination: LoggerDestination, metrics: dict[str, float], step: int) -> None:
        """`metrics` went to `destination` at `step` (noted for a console only)."""
        if self._broken or not isinstance(destination, ConsoleLogger):
            return
        held = self._pending.get(id(destination))
        if held is None or _printed_since(held[0], held[1]):
            self._pending[id(destination)] = (destination, step, dict(metrics))
        else:  # as the console merges them: a key of an earlier step stays until replaced
            self._pending[id(destination)] = (destination, step, {**held[2], **metrics})

    def resend(self, who: str, strict: bool = False) -> None:
        """Log again to each console what it has not printed (class doc), as `deliver` does.
        Without `strict` `deliver` raises nothing, so an error reaching here is ours."""
        if self._broken:
            return
        try:
            for key, (console, step, metrics) in list(self._pending.items()):
                if _printed_since(console, step):
                    del self._pending[key]
                else:
                    deliver([console], "metrics",
                            lambda d, m=metrics, s=step: d.log_metrics(m, s), who, strict)
        except Exception as error:
            if strict:
                raise
            self._broken = True
            self._pending.clear()
            log.error("%s: internal error resending its series to the console (%r); the console "
                      "gets no more of them, the other loggers get everything and training goes "
                      "on", who, error, exc_info=error)

    def fit_end(self, who: str, strict: bool = False) -> None:
        """The console's own fit end prints what it holds, this fit's last: nothing after it
        (an evaluation after the fit) is a training step's."""
        self.resend(who, strict)
        self._pending.clear()


def _printed_since(console: ConsoleLogger, step: int) -> bool:
    """Whether `console` printed after the batch `step` ended (the batch count of its last print
    is past `step`); True where a Composer without `last_logged_batch` leaves it unknown."""
    printed = getattr(console, "last_logged_batch", None)
    return not isinstance(printed, int) or printed > step


#: Per metric name MLflow would be sent, whether it accepts it (checked once per name).
_mlflow_names: dict[str, bool] = {}


def mlflow_accepted(destination: LoggerDestination, metrics: dict[str, float],
                    who: str) -> dict[str, float]:
    """`metrics` without the names an MLflow destination refuses (MLflow's own check,
    mlflow/utils/validation.py `_validate_metric_name`: a `%` in TE's `underflows%`, ...), warned
    once per destination. Composer's MLflow logger logs asynchronously by default, and MLflow's
    queue drops the whole batch holding a refused name: every metric of the step, Composer's
    loss queued with them included ("Failed to log run data", a log line of MLflow's thread)."""
    from composer.loggers import MLFlowLogger

    if not isinstance(destination, MLFlowLogger):
        return metrics
    try:
        from mlflow.utils.validation import _validate_metric_name
    except ImportError:  # another MLflow: its own check decides
        return metrics

    def accepted(name: str) -> bool:
        if name not in _mlflow_names:
            try:
                _validate_metric_name(name)
                _mlflow_names[name] = True
            except Exception:
                _mlflow_names[name] = False
        return _mlflow_names[name]

    refused = [key for key in metrics if not accepted(destination.rename(key))]
    if not refused:
        return metrics
    kinds = _warned_kinds(destination)
    if "names" not in kinds:
        kinds.add("names")
        log.warning("%s: MLflow refuses the metric names %s%s; they are left out of MLflow only "
                    "(every other logger gets them), so that MLflow does not drop the step's "
                    "other metrics with them", who, ", ".join(refused[:3]),
                    f" and {len(refused) - 3} more" if len(refused) > 3 else "")
    return {key: value for key, value in metrics.items() if key not in refused}


#: The longest hyperparameter value every logger keeps whole: MLflow cuts a param's value at
#: 6000 characters (mlflow/utils/validation.py, MAX_PARAM_VAL_LENGTH) with only its own warning.
HPARAM_MAX_CHARS = 6000


class FitEndKeys:
    """The hyperparameter keys of a text a callback logs at each fit's end (one per callback).

    `name` at the first fit of a run that started at batch 0, else `name.ba<step>`
    (`.ba<step>.<n>` if this process used that one already: fit() again with reset_time). W&B
    and MLflow refuse a changed value under a key, and a resumed or second fit ends with other
    values; MLflow's asynchronous logger then drops the whole queued batch, the run's other
    params and metrics included. The suffix uses only characters MLflow accepts in a key (no
    `@`), and no `/` (its file store keeps `name` as a file)."""

    def __init__(self, name: str):
        self.name = name
        self._first = True  # this fit is the process's first, and began at batch 0
        self._started = False
        self._used: set[str] = set()

    def fit_start(self, batch: int) -> None:
        self._first = not self._started and batch == 0
        self._started = True

    def key(self, step: int) -> str:
        """This fit's key, for a fit ending at batch count `step`."""
        key = self.name if self._first and self.name not in self._used else \
            f"{self.name}.ba{step}"
        n = 1
        while key in self._used:
            n += 1
            key = f"{self.name}.ba{step}.{n}"
        self._used.add(key)
        return key


def capped(text: str, whole: str, limit: int = HPARAM_MAX_CHARS) -> str:
    """`text` cut at a line end to fit `limit` characters, its last line saying how many lines
    were left out and where `whole` (the full text) is."""
    if len(text) <= limit:
        return text
    lines = text.splitlines()
    kept: list[str] = []
    size = 0
    for line in lines:
        note = f"... {len(lines) - len(kept)} more lines: {whole}"
        if size + len(line) + 1 + len(note) > limit:
            return "\n".join([*kept, note])
        kept.append(line)
        size += len(line) + 1
    return text


def flush_mlflow(destinations: Iterable[LoggerDestination]) -> None:
    """Send what MLflow's asynchronous queue holds, where a Composer MLflow logger logs. Composer
    logs `enabled_algorithms/<algorithm>` again at each fit's start (trainer.py `_train_loop`),
    and MLflow refuses a queued batch naming a parameter twice ("Duplicate parameter keys"),
    taking every parameter and metric queued with it: a second fit() within the logger's
    `logging_buffer_seconds` (10) of the first fit's end lost the whole run."""
    if any(mlflow_logging(d) for d in destinations):
        import mlflow

        mlflow.flush_async_logging()


def mlflow_logging(destination: LoggerDestination) -> bool:
    """Whether `destination` is a Composer MLflow logger that logs (rank 0's; Composer turns
    the others off)."""
    from composer.loggers import MLFlowLogger

    return isinstance(destination, MLFlowLogger) and bool(getattr(destination, "_enabled", False))
