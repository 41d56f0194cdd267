"""An offline W&B run file as W&B's own writer leaves it (wandb.sdk.internal.datastore), for the
report's tests: a config record where given, one history row per step, and the exit record
`wandb.finish()` writes last where `finished`."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any


def write_wandb_run(path: Path, steps: Iterable[int], row: Callable[[int], Mapping[str, Any]],
                    *, config: Mapping[str, Any] | None = None, finished: bool = True) -> Path:
    """Write `path` (its folders made): `row(step)` is the history row logged at each step."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    path.parent.mkdir(parents=True, exist_ok=True)
    store = DataStore()
    store.open_for_write(str(path))
    if config:
        record = wandb_internal_pb2.Record()
        for key, value in config.items():
            record.config.update.add(key=key, value_json=json.dumps(value))
        store.write(record)
    for step in steps:
        record = wandb_internal_pb2.Record()
        record.history.step.num = step
        for key, value in {**row(step), "_step": step}.items():
            record.history.item.add(key=key, value_json=json.dumps(value))
        store.write(record)
    if finished:
        record = wandb_internal_pb2.Record()
        record.exit.exit_code = 0
        store.write(record)
    store.close()
    return path
