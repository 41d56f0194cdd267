"""What a W&B offline run really holds, read back with W&B's own reader (torch-free).

`wandb.log` can accept a metric and still drop it (a step lower than one already logged), so
"the logger was called" or "the run folder exists" says nothing about what a user will see. This
reads the run's `.wandb` file with `wandb.sdk.internal.datastore.DataStore` and W&B's record
protobufs, the way `wandb sync` does before uploading: the history rows with their steps, the
media (images, tables) and the config. Used by the tests and by `make run`'s demo.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import struct
import tempfile
import time
import warnings
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
    complete: bool = False  # the run's exit record is written: nothing more will come
    killed: bool = False  # no exit record, and none will come (`read_runs`' `dead`)
    # the byte where W&B's reader met a damaged block with more written after it (`_records`)
    damaged_at: int | None = None
    # why W&B's reader read none of the file: its header refused (`_header_refused`)
    unreadable: str | None = None
    run_id: str = ""  # the id of the file's first run record
    # the run id of a run record after an exit record, or of another run's (a file joined from
    # several: W&B writes one attempt per file, `scan`); None where there is none
    joined: str | None = None

    def steps(self, key: str) -> list[int]:
        """The steps of the rows that hold `key`, in order."""
        return [row["_step"] for row in self.rows if key in row]

    def keys(self) -> set[str]:
        return {key for row in self.rows for key in row if not key.startswith("_")}

    def table(self, key: str, step: int) -> tuple[list[str], list[list[Any]]]:
        """(columns, rows) of the table logged as `key` at `step`, from the run's media file."""
        value = next(row[key] for row in self.rows if row["_step"] == step and key in row)
        data = json.loads((self.path.parent / "files" / value["path"]).read_text())
        return data["columns"], data["data"]

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


def _records(run: WandbRun) -> Iterator[Any]:
    """The run file's records as W&B's reader gives them, up to where it stops: the end, or a
    block it asserts on (wandb/sdk/internal/datastore.py `scan_data`: a checksum or length that
    does not match). Where whole blocks follow that one (`_written_after`), the file is damaged
    there, not merely cut short by a kill: `run.damaged_at`."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import LEVELDBLOG_BLOCK_LEN, DataStore

    store = DataStore()
    try:
        try:
            _open_for_scan(store, run.path)
        except OSError:
            raise
        except Exception:  # noqa: BLE001 - an assert on a header cut short, a bare Exception
            run.unreadable = _header_refused(run.path)  # on one not W&B's: nothing to read
            return
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            yield record
    except AssertionError:  # W&B's reader asserts on a truncated or damaged block
        at = store._index  # where it stopped: W&B's reader keeps its position nowhere public
        if _written_after(run.path, -(-(at + 1) // LEVELDBLOG_BLOCK_LEN) * LEVELDBLOG_BLOCK_LEN):
            run.damaged_at = at
    finally:
        store.close()


#: Why W&B's reader may not open a run file that can be read: it opens it read-write (wandb
#: 0.18 sdk/internal/datastore.py `DataStore.open_for_scan`: open(fname, "r+b")), which another
#: user's run (EACCES), a read-only mount (EROFS) or an immutable file (EPERM) refuses.
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _open_for_scan(store: Any, path: Path) -> None:
    """`store.open_for_scan(path)`; where its read-write open is refused (`NOT_WRITABLE`), the
    same on a private copy (mode 0600, in TMPDIR), removed as soon as W&B's reader has opened it:
    its open file keeps the bytes, so no copy outlives the read on any path. Only a regular
    file is copied (opened without waiting: a FIFO there would block), and only where TMPDIR
    has room for it; else an OSError says why, as for a file that cannot be read at all."""
    try:
        store.open_for_scan(str(path))
        return
    except OSError as e:
        if e.errno not in NOT_WRITABLE:
            raise
        refused = e
    try:
        opened = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror}: you may not read it either (ask the run's owner "
                      "to make it readable to you)") from e
    with os.fdopen(opened, "rb") as source:
        info = os.fstat(source.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise refused
        folder = tempfile.gettempdir()
        try:
            if info.st_size > (free := shutil.disk_usage(folder).free):
                raise OSError(errno.ENOSPC, f"it needs {_mib(info.st_size)}, {_mib(free)} free")
            fd, copy = tempfile.mkstemp(prefix="foundry-fp8-", suffix=f"-{path.name}", dir=folder)
        except OSError as e:
            raise _not_copied(refused, folder, e) from e
        try:
            try:
                with os.fdopen(fd, "wb") as target:
                    shutil.copyfileobj(source, target, 1 << 20)
            except OSError as e:
                raise _not_copied(refused, folder, e) from e
            store.open_for_scan(copy)
        finally:
            os.unlink(copy)


def _not_copied(refused: OSError, folder: str, error: OSError) -> OSError:
    """Why the private copy of a run file W&B's reader may not open read-write was not made."""
    return OSError(error.errno, f"{refused.strerror} opening it read-write, as W&B's reader does, "
                   f"and a private copy in TMPDIR ({folder}) failed: {error.strerror or error}; "
                   "set TMPDIR to a folder you may write, with room for it")


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _header_refused(path: Path) -> str:
    """Why W&B's reader refused the run file's header (wandb/sdk/internal/datastore.py
    `_read_header`: LEVELDBLOG_HEADER_LEN bytes, the ident `:W&B`, the magic number, the
    version this W&B reads), said of the bytes there."""
    import wandb
    from wandb.sdk.internal.datastore import (
        LEVELDBLOG_HEADER_IDENT,
        LEVELDBLOG_HEADER_LEN,
        LEVELDBLOG_HEADER_MAGIC,
        LEVELDBLOG_HEADER_VERSION,
    )

    try:
        with open(path, "rb") as f:
            head = f.read(LEVELDBLOG_HEADER_LEN)
    except OSError as e:
        return f"cannot read ({e.strerror or e})"
    expected = struct.pack("<4sHB", LEVELDBLOG_HEADER_IDENT.encode(), LEVELDBLOG_HEADER_MAGIC,
                           LEVELDBLOG_HEADER_VERSION)
    if not head:
        return "empty: W&B has not written its header (a run starting now, or killed as it started)"
    if len(head) < LEVELDBLOG_HEADER_LEN:
        return (f"{len(head)} byte(s), cut short inside W&B's {LEVELDBLOG_HEADER_LEN}-byte "
                "header: damaged (a copy that stopped, a full disk)")
    if head[:-1] == expected[:-1]:
        return (f"W&B run file version {head[-1]}, which this W&B ({wandb.__version__}, version "
                f"{LEVELDBLOG_HEADER_VERSION}) does not read: read it with the W&B that wrote it")
    return (f"damaged header: its first {LEVELDBLOG_HEADER_LEN} bytes are {head.hex(' ')}, not "
            f"W&B's {expected.hex(' ')} (`{LEVELDBLOG_HEADER_IDENT}`, magic number, version)")


def _written_after(path: Path, offset: int) -> bool:
    """Whether the file holds a nonzero byte from `offset` on (a kill leaves nothing there; a
    power cut leaves zeros)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            while chunk := f.read(1 << 20):
                if chunk.strip(b"\0"):
                    return True
    except OSError:
        return False
    return False


def _item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def _put(row: dict[str, Any], path: list[str], value: Any) -> None:
    """W&B writes a media value (an image list, a table) as one item per field, with the
    path `[key, field, ...]`: put it back together as the dict that was logged."""
    for part in path[:-1]:
        row = row.setdefault(part, {})
    row[path[-1]] = value


def read_run(path: str | Path) -> WandbRun:
    """Read one `.wandb` file (a run still being written may end in a partial record: what
    precedes it is returned)."""
    run = WandbRun(Path(path))
    run.rows.extend(scan(run))
    return run


def scan(run: WandbRun, history: bool = True) -> Iterator[dict[str, Any]]:
    """`run.path`'s history rows one at a time, not kept (a long run's history is gigabytes as
    dicts: the report folds each row in and drops it), filling `run`'s config, files and
    `complete` on the way; with `history=False` each row holds its `_step` alone, the values
    left unparsed (a run's config and steps). Ends at a partial last record, as `read_run`
    does.

    W&B writes one attempt of one run per file (wandb-core truncates a run file it opens: two
    attempts given the same folder leave the second alone), so a run record after the exit
    record, or one of another run id, is a file joined from several (`joined`): the same run's
    next attempt is read on, as `wandb sync` sends it; another run's records are not this run's
    and end the scan (`wandb sync` would stream their history into this run: wandb 0.18
    sdk/internal/sender.py `send_run` starts the file stream for the first run record only)."""
    exited = False
    for record in _records(run):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                path = list(item.nested_key) or [item.key]
                if history or path == ["_step"]:
                    _put(row, path, json.loads(item.value_json))
            row.setdefault("_step", record.history.step.num)
            yield row
        elif kind == "config":
            for item in record.config.update:
                run.config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "run":
            run_id = record.run.run_id
            if run_id and run.run_id and (exited or run_id != run.run_id):
                run.joined = run_id
                if run_id != run.run_id:
                    return
                exited = run.complete = False  # the next attempt's exit record is to come
            run.run_id = run.run_id or run_id
            for item in record.run.config.update:
                run.config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "exit":
            exited = run.complete = True
        elif kind == "files":
            run.files.extend(f.path for f in record.files.files)


def dead(path: Path, files: list[Path]) -> bool:
    """A run file with no exit record that will never get one: a later attempt of the same run
    id (`resume`) started after it. Not a file merely quiet for a while: W&B's service can write
    a finished run's last records well after `wandb.finish()` on a loaded machine (seen: a
    30 s rule read finished runs as killed, without their history)."""
    later = files[files.index(path) + 1:] if path in files else []
    return any(other.name == path.name for other in later)


def read_runs(folder: str | Path, wait: float = 0.0) -> list[WandbRun]:
    """Every offline run under `folder`; with `wait`, up to that many seconds for W&B's
    service to finish writing them (`wandb.finish()` can return before the file is complete),
    but not for a killed attempt's file (`dead`: read as it stands, `killed`). Past `wait` with
    a file still unfinished, one warning names it and the runs are returned as they stand."""
    deadline = time.monotonic() + wait
    while True:
        files = run_files(folder)
        runs = [read_run(path) for path in files]
        for run in runs:
            run.killed = not run.complete and dead(run.path, files)
        pending = [run.path for run in runs if not (run.complete or run.killed)]
        if not pending or time.monotonic() > deadline:
            if pending and wait:
                warnings.warn(f"{pending[0]}: no exit record after waiting {wait:g} s: read as "
                              f"it stands (a process killed, or W&B's service still writing)",
                              stacklevel=2)
            return runs
        time.sleep(0.5)


def describe(runs: Iterable[WandbRun]) -> str:
    """A few lines on what reached W&B, per run: history rows, the FP8 summary series and the
    per-layer series (`health.keys` layout) with their steps, the images and the tables."""
    from foundry_fp8.health.keys import SUMMARY_PREFIX, parse_key

    lines = []
    for run in runs:
        keys = run.keys()
        layers = sorted(k for k in keys if parse_key(k))
        summary = sorted(k for k in keys if k.startswith(f"{SUMMARY_PREFIX}/"))
        lines.append(f"{run.path}: {len(run.rows)} history rows" + (
            "" if run.complete else " (no exit record: the run was killed)" if run.killed
            else " (no exit record: the run was killed, or is still writing)"))
        for label, found in (("summary", summary), ("per-layer", layers)):
            steps = sorted({s for k in found for s in run.steps(k)})
            lines.append(f"  {len(found)} FP8 {label} series at steps {steps or 'none'}"
                         + (f", e.g. {found[0]}" if found else ""))
        for kind, label in (("images/separated", "images"), ("image-file", "image"),
                            ("table-file", "table")):
            for key, at in sorted(run.media(kind).items()):
                lines.append(f"  {label} {key} at steps {at}")
    return "\n".join(lines) or "no W&B offline run found"


#: What W&B's service (wandb-core 0.18) writes to an attempt's `logs/debug-internal.log` for a
#: history row it drops, one logged at a step below the current one; its `step` names the row.
DROPPED_ROW = b"handler: ignoring partial history record"


def dropped_steps(run_file: Path) -> list[int]:
    """The steps of the history rows W&B's service dropped from `run_file`'s attempt, from the
    attempt's own log: nothing in the `.wandb` file says a row was dropped (older foundry-fp8
    builds logged fp8_stats' metrics a step behind, and W&B kept none of them). Only a regular
    file is opened, and without waiting: a FIFO there would block the report forever, a device
    is not W&B's."""
    log = run_file.parent / "logs" / "debug-internal.log"
    steps: set[int] = set()
    try:
        if not stat.S_ISREG(log.stat().st_mode):
            return []
        with os.fdopen(os.open(log, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            for line in f:
                if DROPPED_ROW not in line:
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                step = record.get("step") if isinstance(record, dict) else None
                if isinstance(step, int) and not isinstance(step, bool):
                    steps.add(step)
    except OSError:
        return []
    return sorted(steps)
