"""Append-only JSONL metric files: the local copy of everything we log (and the `jsonl`
logger's other file operations: hparams.json replaced in one step, an earlier run set aside, the
lock that keeps a second process from writing the same file).

One line per logging call: `{"step": int, "metrics": {name: float}}`. Plain Python (no torch),
so readers such as `foundry-fp8 report` stay light.
"""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import stat
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

try:
    import fcntl
except ImportError:  # Windows: no flock; the logger writes without a lock (lock_writer: None)
    fcntl = None  # type: ignore[assignment]

#: How every record written by JsonlSink starts (json.dumps escapes `"` inside strings, so these
#: bytes appear nowhere else): where a killed run's partial line got glued to the next record,
#: the reader finds that record at the last occurrence.
RECORD_START = '{"step": '


def _jsonable(value: Any) -> Any:
    """`value` as JSON takes it: a tensor or numpy value as its number, or as a list of them
    where it holds several (a per-class metric, which Composer logs as `compute()` returns it:
    `.item()` raised there, and the `jsonl` logger stopped for the rest of the run)."""
    if hasattr(value, "tolist") and callable(value.tolist):
        value = value.tolist()
    if isinstance(value, list):
        return [_jsonable(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible instead of dropping them
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)


def jsonable_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A record's metrics as written: names as strings, values as `_jsonable` makes them."""
    return {str(k): _jsonable(v) for k, v in metrics.items()}


class JsonlSink:
    """Writes metric records to one JSONL file, creating its folder on first write.

    Each record goes out in one `write` of a whole line. A file that does not end in a newline
    (a run killed mid-write, then resumed into the same file) first gets one, so the new record
    starts its own line instead of being glued to the partial one.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        #: (device, inode, size) of the file after the last record; None before the first (or
        #: after the writer replaced the file itself)
        self.last_file: tuple[int, int, int] | None = None

    def write(self, step: int, metrics: Mapping[str, Any]) -> bool:
        """Append one record; False where the file at `path` is not the one the previous
        record went to, or is shorter (removed, moved, replaced or cut since: the records before
        are not in it; the size tells a new file whose inode number the OS reused)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": int(step), "metrics": jsonable_metrics(metrics)}
        line = (json.dumps(record) + "\n").encode("utf-8")
        with self.path.open("a+b") as f:  # appends wherever we seek
            found = os.fstat(f.fileno())
            size = f.seek(0, os.SEEK_END)
            last = self.last_file
            same = last is None or (last[:2] == (found.st_dev, found.st_ino) and size >= last[2])
            if size > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = b"\n" + line
            f.write(line)
            end = f.tell()
        # noted once the close has flushed the line: a failed append (a full disk refuses the
        # bytes at the flush) leaves the note as it was, or the next record would read the
        # file as cut since
        self.last_file = (found.st_dev, found.st_ino, end)
        return same

    def unchanged(self) -> bool:
        """Whether the file at `path` is the one the last record went to, at its size then:
        nobody wrote to it since."""
        try:
            found = self.path.stat()
        except OSError:
            return False
        return self.last_file == (found.st_dev, found.st_ino, found.st_size)


def write_atomically(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data` (text as UTF-8) in one step (a temporary file in the same
    folder, then `os.replace`): a kill or a full disk mid-write leaves the old file whole, never
    a cut one. The temporary file is created new (`x`), so even a FIFO left under its name
    cannot make the write wait."""
    temporary = _temporary(path)
    temporary.unlink(missing_ok=True)  # a killed run's leftover of this pid
    try:
        with temporary.open("xb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def set_plain_mode(path: Path) -> None:
    """Give `path`, which a library wrote through a temporary file and a rename (safetensors'
    `save_file`, through Rust's tempfile: 0600), the mode a plain open() gives a new file in its
    folder (0o666 less the umask, or what the folder's default ACL gives), as every other file
    of the run has: other users of a shared cluster, or a job's other uid, read it. Taken from a
    file created that way (the umask cannot be read without setting it, for every thread). A
    file system that keeps its own modes (vfat, some CIFS mounts) refuses chmod: `path` stays
    as it gave it."""
    probe = path.with_name(f".{path.name}.{os.getpid()}.mode")
    try:
        probe.unlink(missing_ok=True)  # a killed run's leftover of this pid
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            mode = stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
            probe.unlink()
        os.chmod(path, mode)
    except OSError:
        return


def file_kind(mode: int) -> str:
    """What a file is, for a message (`a file`, `a FIFO (named pipe)`)."""
    kinds = ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((kind for test, kind in kinds if test(mode)), "a special file")


def check_output(path: Path) -> None:
    """OSError (its strerror says what stands there) where `path` is neither absent nor a
    regular file (or a link to one): opening a FIFO to write waits for a reader forever, and a
    device or folder is not ours to replace."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise OSError(errno.EEXIST, f"{file_kind(mode)}, not a regular file: remove it, or "
                      "write elsewhere", str(path))


def write_output(path: Path, data: str | bytes) -> None:
    """Write one of our output files (the report and its PNGs, the bench's results): refused
    (`check_output`) where something else than a regular file stands, else replaced whole in
    one step (`write_atomically`; through a symbolic link, its target), so no write can wait on
    a FIFO nor leave a cut file."""
    check_output(path)
    write_atomically(path.resolve() if path.is_symlink() else path, data)


def check_writable(path: Path) -> None:
    """OSError where `write_output(path, ...)` would be refused for its folder (a read-only
    mount, another user's folder; ACLs and root squash included, which permission bits do not
    show): its temporary file is created there and removed at once. A folder not there yet is
    judged by the nearest one above that is, where it would be created."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    probe = _temporary(folder / path.name)
    probe.unlink(missing_ok=True)  # a killed run's leftover of this pid
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    probe.unlink()


def _temporary(path: Path) -> Path:
    """This process's temporary file beside `path` (a kill may leave it behind)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def numbered(path: Path, n: int) -> Path:
    """`metrics.jsonl` -> `metrics.<n>.jsonl`: where an earlier run's file is kept."""
    return path.with_name(f"{path.stem}.{n}{path.suffix}")


def hparams_of(metrics_file: Path) -> Path:
    """The hparams.json written with a metrics file: for an earlier run's records set aside as
    `<name>.<n>.jsonl`, its `hparams.<n>.json` where that exists; else `hparams.json` beside."""
    hparams = metrics_file.with_name("hparams.json")
    n = metrics_file.stem.rpartition(".")[2]
    if n.isdigit() and (aside := numbered(hparams, int(n))).is_file():
        return aside
    return hparams


def claim_numbered(path: Path, hparams: Path) -> int:
    """The first n from 1 where neither `metrics.<n>.jsonl` nor `hparams.<n>.json` stands;
    `metrics.<n>.jsonl` is created empty and exclusively, so a concurrent claim gets another n."""
    return next(n for n in itertools.count(1)
                if not numbered(hparams, n).exists() and _created(numbered(path, n)))


def _created(path: Path) -> bool:
    """Create `path` empty; False where something stands there already."""
    try:
        path.open("xb").close()
    except FileExistsError:
        return False
    return True


def set_aside(path: Path, keep: int, aside: Path,
              before_replace: Callable[[Path], object]) -> None:
    """Move the first `keep` bytes of `path` (an earlier run's records) to `aside` (claimed:
    `claim_numbered`) and leave what follows them (this run's) in a new file at `path`;
    `before_replace` gets that new file before it takes `path`'s place (the writer moves its
    lock to it, so no other writer can take the path in between)."""
    with path.open("rb") as f:
        f.seek(keep)
        ours = f.read()
    temporary = _temporary(path)  # ours first into a new file, so a kill on the way loses nothing
    temporary.write_bytes(ours.removeprefix(b"\n"))  # a newline only after a cut line
    before_replace(temporary)
    os.rename(path, aside)
    os.replace(temporary, path)
    os.truncate(aside, keep)


#: The writer locks this process holds: (device, inode) of a metrics file -> [fd, holders].
#: flock locks belong to an open file, so a second logger of this process on the same file (a
#: second Trainer of the run, in a notebook or a test) shares the first one's.
_LOCKS: dict[tuple[int, int], list[int]] = {}


def _forget_locks() -> None:
    """In a forked child (a DataLoader worker): drop its copies of the locked files, which would
    keep the lock alive after a killed parent, until the worker noticed and exited."""
    for fd, _ in _LOCKS.values():
        os.close(fd)
    _LOCKS.clear()


if hasattr(os, "register_at_fork"):  # POSIX only; no fork and no lock elsewhere
    os.register_at_fork(after_in_child=_forget_locks)


def lock_writer(path: Path) -> tuple[int, int] | str | None:
    """Take the advisory writer lock of `path` (created if absent) for this process (flock,
    non-blocking; the OS drops it when the process dies, so a killed run leaves none): its key
    for `unlock_writer`; or, where another process holds it, who (`pid N`, else `another
    process`); None where the file system or the OS takes no locks (nothing is checked then).
    OSError where `path` is no regular file (`check_output`): a FIFO in its place would make
    the open for writing wait for a reader forever (one put there after the check fails with
    ENXIO instead: O_NONBLOCK)."""
    check_output(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0), 0o666)
    found = os.fstat(fd)
    key = (found.st_dev, found.st_ino)
    if key in _LOCKS:
        os.close(fd)
        _LOCKS[key][1] += 1
        return key
    try:
        if fcntl is None:
            raise OSError(errno.ENOSYS, "no flock")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        return _holder(key) if isinstance(e, BlockingIOError) else None
    _LOCKS[key] = [fd, 1]
    return key


def unlock_writer(key: tuple[int, int]) -> None:
    """Give back one hold of `lock_writer`'s lock; the last one releases it."""
    held = _LOCKS[key]
    held[1] -= 1
    if not held[1]:
        del _LOCKS[key]
        os.close(held[0])


def _holder(key: tuple[int, int]) -> str:
    """Who holds the flock of the file `key`, from Linux's /proc/locks (`N: FLOCK ADVISORY
    WRITE <pid> <major>:<minor>:<inode> ...`, major and minor in hex: fs/locks.c,
    lock_get_status); `another process` where it does not say (another OS, another host)."""
    device = f"{os.major(key[0]):02x}:{os.minor(key[0]):02x}:{key[1]}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        lines = []
    pids = {fields[4] for fields in map(str.split, lines)
            if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == device}
    return f"pid {pids.pop()}" if len(pids) == 1 and pids != {"0"} else "another process"


def number(value: Any) -> float | None:
    """A logged value as a float; None where it is no number to plot or judge: another type, a
    bool, or an integer too large for a float (JSON has no size limit)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


#: Steps beyond this are not a training's (and not exact in float64, which plotting uses).
MAX_STEP = 2**53
#: What a step is, as messages say it (`2**53` for MAX_STEP).
STEP_RANGE = f"an integer from 0 to 2**{MAX_STEP.bit_length() - 1}"


def step(value: Any) -> int | None:
    """A logged step as an int; None where it is none: another type, a bool, or outside 0 to
    MAX_STEP (JSON has no size limit)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEP:
        return None
    return value


#: What `json.loads` raises for a line that does not decode: not JSON, not UTF-8 (ValueError),
#: or nested deeper than the parser goes (RecursionError).
UNDECODABLE = (ValueError, RecursionError)


class JsonlError(ValueError):
    """A file that is not a metrics file: a line that is JSON but not a `{"step", "metrics"}`
    record, or no record at all; the message names file, line and key."""


def _shown(value: Any) -> str:
    """A decoded value as JSON, cut to 40 characters for a one-line message."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def json_kind(value: Any) -> str:
    """What a decoded JSON value is, in JSON's own words (`an array`, `null`), not Python's
    (`list`, `NoneType`)."""
    if value is None:
        return "null"
    kinds = ((bool, "a boolean"), (dict, "an object"), (list, "an array"), (str, "a string"))
    return next((kind for type_, kind in kinds if isinstance(value, type_)), "a number")


def _record(value: Any, where: str) -> tuple[int, dict[str, Any]]:
    """(step, metrics) of one decoded line, or JsonlError naming the key at fault."""
    if not isinstance(value, dict):
        raise JsonlError(f"{where}: not a metrics record ({json_kind(value)}, expected "
                         '{"step": int, "metrics": {...}})')
    for key in ("step", "metrics"):
        if key not in value:
            raise JsonlError(f"{where}: not a metrics record (no key {key!r})")
    step_, items = step(value["step"]), value["metrics"]
    if step_ is None:
        raise JsonlError(f"{where}: key 'step': expected a step ({STEP_RANGE}), got "
                         f"{_shown(value['step'])}")
    if not isinstance(items, dict):
        raise JsonlError(f"{where}: key 'metrics': expected an object, got "
                         f"{_shown(items)}")
    metrics = {}
    for key, item in items.items():
        if isinstance(item, str) and item in ("nan", "inf", "-inf"):
            item = float(item)
        metrics[key] = item
    return step_, metrics


#: The longest line the reader takes, in bytes. A logging step of MPT-1B's fp8_stats (3,456
#: per-layer series, 96 layers x 3 tensors x 12 statistics) is a 233 KiB line (measured with
#: JsonlSink); a line 280 times that is no record of ours (a run of NULs a power loss left in
#: the file, another file), and is read through in chunks, never held whole: the reader's memory
#: stays bounded by this whatever the file holds.
MAX_LINE_BYTES = 64 * 2**20
#: How much of a line over MAX_LINE_BYTES is read at a time while it is skipped.
_SKIP_CHUNK = 2**20


def _lines(f: BinaryIO) -> Iterator[bytes | None]:
    """Each line of `f` (its newline kept), or None for a line longer than MAX_LINE_BYTES, which
    is read through in chunks and dropped. A line with no newline is the end of the file as
    read, and the last: a writer still writing it finishes it later, and what readline returned
    then would be its tail as a line of its own (the record lost in two undecodable halves)."""
    while raw := f.readline(MAX_LINE_BYTES + 1):
        if raw.endswith(b"\n") or len(raw) <= MAX_LINE_BYTES:
            yield raw
            if not raw.endswith(b"\n"):
                return
            continue
        raw = b""  # not kept while the rest of the line is read through
        while (rest := f.readline(_SKIP_CHUNK)) and not rest.endswith(b"\n"):
            pass
        yield None
        if not rest:  # the file ended inside it
            return


def _cause(error: Exception) -> str | None:
    """Why a line that does not decode was written so, where it is not a cut or garbled line
    (a kill's): for the warning, which would otherwise blame a kill."""
    if isinstance(error, RecursionError):  # json's decoder recurses once per bracket
        return "nested deeper than Python's json decodes (no logger writes one)"
    if isinstance(error, ValueError) and not isinstance(error, (json.JSONDecodeError,
                                                                 UnicodeDecodeError)):
        # json's int() of a literal past sys.get_int_max_str_digits() (CPython's guard against
        # quadratic-time conversions): "Exceeds the limit (4300 digits) ...: value has N digits"
        digits = str(error).rpartition("value has ")[2].partition(" digits")[0]
        limit = f"the {sys.get_int_max_str_digits():,} Python's int() reads"
        return (f"a number of {int(digits):,} digits, more than {limit}" if digits.isdigit() else
                f"a number of more digits than {limit}") + " (no logger writes one)"
    return None


def read_jsonl(path: str | os.PathLike[str], skipped: list[int] | None = None,
               too_long: list[int] | None = None, cut: list[int] | None = None,
               causes: dict[int, str] | None = None
               ) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield `(step, metrics)` per line; string NaN/Inf come back as floats.

    A line that does not decode (not JSON, not UTF-8) is what a run killed mid-write leaves:
    cut short at the end of the file, or, once a resumed run appended to it, glued to the next
    record (whose line then still yields that record). Any number of such lines, of lines
    nested too deep to decode and of lines longer than MAX_LINE_BYTES (also appended to
    `too_long`: left unread) is skipped and their numbers appended to `skipped` (the caller
    warns once); each crash leaves at most one; `causes` gets why, by line number, for a line
    no crash leaves (a number Python will not convert, nesting too deep). A UTF-8 byte order
    mark at a line's start is read past, as `json.loads` reads one on bytes (an editor's save,
    PowerShell's `Out-File`). The last line read, where it had no newline
    and yielded nothing, is also appended to `cut`: the one a writer may still be writing (a
    skipped line before it is a crash's).
    A line that decodes but is not a `{"step": int, "metrics": {...}}` record raises JsonlError
    naming file, line and key (no writer of ours produces it: it is another file), and so does
    a file with no record at all but undecodable lines. Blank lines are ignored.
    """
    skipped = [] if skipped is None else skipped
    first_skipped = len(skipped)
    records = 0
    error = ""
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(_lines(f), 1):
            where = f"{path}:{lineno}"
            if raw is None:
                error = error or f"line {lineno}: longer than {MAX_LINE_BYTES:,} bytes"
                skipped.append(lineno)
                if too_long is not None:
                    too_long.append(lineno)
                continue
            try:
                line = raw.decode("utf-8-sig")
                if not line.strip():
                    continue
                value = json.loads(line)
            except UNDECODABLE as e:
                error = error or f"line {lineno}: {type(e).__name__}: {e}"
                skipped.append(lineno)
                if causes is not None and (cause := _cause(e)) is not None:
                    causes[lineno] = cause
                glued = _glued_record(raw, where)
                if glued is not None:
                    records += 1
                    yield glued
                elif cut is not None and not raw.endswith(b"\n"):
                    cut.append(lineno)
                continue
            records += 1
            yield _record(value, where)
    if not records and len(skipped) > first_skipped:
        bad = len(skipped) - first_skipped
        raise JsonlError(f"{path}: no metrics record; {bad} line{' does' if bad == 1 else 's do'}"
                         f" not decode as JSON ({error[:120]})")


def _glued_record(raw: bytes, where: str) -> tuple[int, dict[str, Any]] | None:
    """The whole record after a partial one on the same line, if there is one."""
    start = raw.rfind(RECORD_START.encode())
    if start <= 0:
        return None
    try:
        return _record(json.loads(raw[start:].decode("utf-8")), where)
    except UNDECODABLE:  # also JsonlError: the tail is not a record either
        return None
