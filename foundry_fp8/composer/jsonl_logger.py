"""A Composer logger destination that mirrors every metric into `<run folder>/metrics.jsonl`.

The run folder (`foundry_fp8.paths`): the parent of a local checkpoint `save_folder`, else
`runs/<run_name>`; a relative `path` is taken inside it."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from composer.core import State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist

from foundry_fp8.jsonl import JsonlSink
from foundry_fp8.options import build
from foundry_fp8.paths import in_run_folder, run_folder, safe_run_name

log = logging.getLogger(__name__)


class JSONLLogger(LoggerDestination):
    """Registered as `jsonl` in LLM-Foundry's loggers: `loggers: {jsonl: {path: ...}}`.

    `path` may contain `{run_name}`; it is checked here, when LLM-Foundry builds the logger. A
    relative `path` is taken inside the run folder (`state_run_folder`) and may not lead out of
    it; an absolute one is used as written.
    Hyperparameters go to `hparams.json` beside it. Only global rank 0 writes, as W&B and
    MLflow do: Composer sends every rank's metrics to every destination, and several ranks
    appending to one file would interleave copies.

    Composer does not guard its logger destinations, so a failure here would end the run. A
    folder that cannot be created or a file that cannot be written (at INIT or mid-run: full
    disk, a folder in the file's place) is logged once, naming the path and the OS error, and
    the logger stops writing while training goes on; `strict: true` raises instead.
    """

    def __init__(self, **options: Any):
        self.options = build("jsonl", options)  # one line naming loggers.jsonl.<key>
        self.path_template: str = self.options.path
        self.strict: bool = self.options.strict
        self.sink: JsonlSink | None = None  # rank 0's file (set even once writing stopped)
        self.stopped = False  # a write failed: nothing more is written
        self._pending_hparams: dict[str, Any] = {}

    def init(self, state: State, logger: Logger) -> None:
        del logger
        if dist.get_global_rank() != 0:
            return
        sink = self.sink = JsonlSink(in_run_folder(self.path_template, state_run_folder(state),
                                                   state.run_name, "loggers.jsonl.path"))

        def can_write() -> None:  # now, not at the first metric: say so before training
            sink.path.parent.mkdir(parents=True, exist_ok=True)
            sink.path.open("ab").close()

        self._guard(can_write, sink.path)
        if self._pending_hparams:
            self.log_hyperparameters({})

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self.sink is not None and not self.stopped:
            sink = self.sink
            self._guard(lambda: sink.write(step if step is not None else -1, metrics), sink.path)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._pending_hparams.update(hyperparameters)
        if self.sink is not None and not self.stopped:
            path = self.sink.path.with_name("hparams.json")
            hparams = self._pending_hparams
            self._guard(lambda: path.write_text(json.dumps(hparams, indent=2, default=str,
                                                           skipkeys=True)), path)

    def _guard(self, call: Callable[[], object], path: Path) -> None:
        """Run a write; on failure warn once and stop writing (`strict`: raise)."""
        try:
            call()
        except Exception as e:
            if self.strict:
                raise
            self.stopped = True
            reason = f"{type(e).__name__}: {e.strerror or e}" if isinstance(e, OSError) else repr(e)
            log.warning("jsonl logger: cannot write %s (%s); it writes nothing more to %s, "
                        "training goes on (loggers.jsonl.strict: true makes this an error)",
                        path, reason, path.parent)


def state_run_folder(state: State) -> Path:
    """`paths.run_folder` of a Composer run: its checkpoint folder filled in as Composer does
    (`format_name_with_dist`), with the run name made safe."""
    from composer.callbacks import CheckpointSaver
    from composer.utils.file_helpers import format_name_with_dist

    for callback in getattr(state, "callbacks", ()):
        if isinstance(callback, CheckpointSaver):
            return run_folder(format_name_with_dist(str(callback.folder),
                                                    safe_run_name(state.run_name)),
                              state.run_name)
    return run_folder(None, state.run_name)
