"""A Composer logger destination that mirrors every metric into `<run folder>/metrics.jsonl`."""

from __future__ import annotations

import json
from typing import Any

from composer.core import State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist

from foundry_fp8.jsonl import JsonlSink

DEFAULT_PATH = "runs/{run_name}/metrics.jsonl"


class JSONLLogger(LoggerDestination):
    """Registered as `jsonl` in LLM-Foundry's loggers: `loggers: {jsonl: {path: ...}}`.

    `path` may contain `{run_name}`. Hyperparameters go to `hparams.json` beside it. Only
    global rank 0 writes, as W&B and MLflow do: Composer sends every rank's metrics to every
    destination, and several ranks appending to one file would interleave copies.
    """

    def __init__(self, path: str = DEFAULT_PATH):
        self.path_template = path
        self.sink: JsonlSink | None = None
        self._pending_hparams: dict[str, Any] = {}

    def init(self, state: State, logger: Logger) -> None:
        del logger
        if dist.get_global_rank() == 0:
            self.sink = JsonlSink(self.path_template.format(run_name=state.run_name))

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self.sink is not None:
            self.sink.write(step if step is not None else -1, metrics)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._pending_hparams.update(hyperparameters)
        if self.sink is not None:
            path = self.sink.path.with_name("hparams.json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self._pending_hparams, indent=2, default=str))
