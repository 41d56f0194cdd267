"""Append-only JSONL metric files: the local copy of everything we log.

One line per logging call: `{"step": int, "metrics": {name: float}}`. Plain Python (no torch),
so readers such as `foundry-fp8 report` stay light.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible instead of dropping them
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


class JsonlSink:
    """Writes metric records to one JSONL file, creating its folder on first write."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": int(step), "metrics": {k: _jsonable(v) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


class JsonlError(ValueError):
    """A line that is not a `{"step", "metrics"}` record; the message names file and line."""


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield `(step, metrics)` per line; string NaN/Inf come back as floats.

    A malformed line (e.g. one cut short by a killed run) raises JsonlError naming file and line.
    """
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step, items = record["step"], record["metrics"].items()
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise JsonlError(f"{path}:{lineno}: not a metrics record "
                                 f"({type(e).__name__}: {e})") from None
            metrics = {}
            for key, value in items:
                if isinstance(value, str) and value in ("nan", "inf", "-inf"):
                    value = float(value)
                metrics[key] = value
            yield step, metrics
