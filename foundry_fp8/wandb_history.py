"""What a W&B offline run really holds, read back with W&B's own reader (torch-free).

`wandb.log` can accept a metric and still drop it (a step lower than one already logged), so
"the logger was called" or "the run folder exists" says nothing about what a user will see. This
reads the run's `.wandb` file with `wandb.sdk.internal.datastore.DataStore` and W&B's record
protobufs, the way `wandb sync` does before uploading: the history rows with their steps, the
media (images, tables) and the config. Used by the tests and by `make run`'s demo.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class WandbRun:
    """One offline run file: `rows` are its history rows ({key: value}, with `_step`) in the
    order written; `config` its hyperparameters."""

    path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)  # media files the run uploads

    def steps(self, key: str) -> list[int]:
        """The steps of the rows that hold `key`, in order."""
        return [row["_step"] for row in self.rows if key in row]

    def keys(self) -> set[str]:
        return {key for row in self.rows for key in row if not key.startswith("_")}

    def media(self, kind: str) -> dict[str, list[int]]:
        """{key: steps} of the history values of one W&B media type (`image-file`,
        `table-file`, or `images/separated` for a list of images)."""
        found: dict[str, list[int]] = {}
        for row in self.rows:
            for key, value in row.items():
                if isinstance(value, dict) and value.get("_type") == kind:
                    found.setdefault(key, []).append(row["_step"])
        return found


def run_files(folder: str | Path) -> list[Path]:
    """The `.wandb` files of every offline run under `folder` (a W&B `dir`, its `wandb/`
    folder, or one run's folder), oldest first (run folders are named by start time)."""
    folder = Path(folder)
    return sorted(folder.glob("**/offline-run-*/run-*.wandb"),
                  key=lambda p: p.parent.name) or sorted(folder.glob("run-*.wandb"))


def _records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    store = DataStore()
    store.open_for_scan(str(path))
    try:
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            yield record
    finally:
        store.close()


def _item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def read_run(path: str | Path) -> WandbRun:
    """Read one `.wandb` file (a run still being written may end in a partial record: what
    precedes it is returned)."""
    run = WandbRun(Path(path))
    records = _records(run.path)
    while True:
        try:
            record = next(records)
        except StopIteration:
            break
        except AssertionError:  # W&B's reader asserts on a truncated last block
            break
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {_item_key(item): json.loads(item.value_json) for item in record.history.item}
            row.setdefault("_step", record.history.step.num)
            run.rows.append(row)
        elif kind == "config":
            for item in record.config.update:
                run.config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "run":
            for item in record.run.config.update:
                run.config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "files":
            run.files.extend(f.path for f in record.files.files)
    return run


def read_runs(folder: str | Path) -> list[WandbRun]:
    return [read_run(path) for path in run_files(folder)]


def describe(runs: Iterable[WandbRun], prefixes: tuple[str, ...] = ("fp8",)) -> str:
    """A few lines on what reached W&B: per run, how many history rows, how many series whose
    key starts with one of `prefixes` and at which steps, and the images and tables."""
    lines = []
    for run in runs:
        keys = sorted(k for k in run.keys() if k.startswith(prefixes))
        steps = sorted({s for k in keys for s in run.steps(k)})
        lines.append(f"{run.path}: {len(run.rows)} history rows; {len(keys)} series "
                     f"({', '.join(prefixes)}*) at steps {steps or 'none'}")
        for kind, label in (("image-file", "image"), ("images/separated", "images"),
                            ("table-file", "table")):
            for key, at in sorted(run.media(kind).items()):
                lines.append(f"  {label} {key} at steps {at}")
    return "\n".join(lines) or "no W&B offline run found"
