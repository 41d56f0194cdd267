"""`fp8_state`: FP8 amax histories and scales saved in, and restored from, Composer checkpoints.

The state lives in this callback's own entry of the checkpoint, keyed by module name, so resuming
never depends on TE's pickled `_extra_state` (which TE >= 2.16 refuses to unpickle by default).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger

from foundry_fp8.fp8_meta import fp8_modules, read_fp8_meta, write_fp8_meta

log = logging.getLogger(__name__)


def fp8_state_from_checkpoint(path: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """The FP8 state `fp8_state` stored in a Composer checkpoint file (empty if none)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    return checkpoint["state"].get("callbacks", {}).get(FP8State.__qualname__, {}).get(
        "modules", {})


class FP8State(Callback):
    """`callbacks: {fp8_state: {strict: true}}`. With `strict`, a checkpoint whose FP8 modules do
    not match the model's is an error naming them; otherwise a warning."""

    def __init__(self, strict: bool = True):
        self.strict = strict
        self._model: torch.nn.Module | None = None
        self._pending: dict[str, dict[str, torch.Tensor]] | None = None

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        del logger
        if event == Event.INIT:
            self._model = state.model  # te_swap has converted it (algorithms run first)
        elif event in (Event.AFTER_LOAD, Event.FIT_START) and self._pending is not None:
            self._restore(self._pending)
            self._pending = None

    def state_dict(self) -> dict[str, Any]:
        if self._model is None:
            return {"modules": {}}
        return {"modules": {name: read_fp8_meta(m) for name, m in fp8_modules(self._model)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = state.get("modules", {})
        if self._model is not None:
            self._restore(self._pending)
            self._pending = None

    def _restore(self, saved: dict[str, dict[str, torch.Tensor]]) -> None:
        assert self._model is not None
        modules = dict(fp8_modules(self._model))
        missing, unexpected = sorted(modules.keys() - saved.keys()), sorted(saved.keys() - modules.keys())
        if missing or unexpected:
            message = (f"fp8_state: checkpoint FP8 modules do not match the model; in the model "
                       f"only: {missing or 'none'}; in the checkpoint only: {unexpected or 'none'}")
            if self.strict:
                raise ValueError(message + " (set fp8_state: {strict: false} to continue)")
            log.warning(message)
        for name in modules.keys() & saved.keys():
            write_fp8_meta(modules[name], saved[name])
        log.info("fp8_state: restored amax history and scales of %d modules",
                 len(modules.keys() & saved.keys()))
