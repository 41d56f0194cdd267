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
from collections.abc import Callable, Iterable

from composer.loggers import LoggerDestination

log = logging.getLogger(__name__)

#: The kinds already warned about, per failing destination, by identity (a destination defined
#: as an `eq=True` dataclass is unhashable); holding the destination keeps its id unique.
_warned: dict[int, tuple[LoggerDestination, set[str]]] = {}


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
    kinds = _warned.setdefault(id(destination), (destination, set()))[1]
    if kind in kinds:
        log.debug("%s: %s failed to log %s again: %r", who, name, kind, error)
        return
    kinds.add(kind)
    log.warning("%s: the logger %s failed to log %s (%s: %s); the other loggers are not "
                "affected and training goes on (warned once per logger and kind)", who, name,
                kind, type(error).__name__, error, exc_info=error)
