"""A Composer logger destination that mirrors every metric into `<run folder>/metrics.jsonl`.

The run folder (`foundry_fp8.paths`): the parent of a local checkpoint `save_folder`, else
`runs/<run_name>`; a relative `path` is taken inside it."""

from __future__ import annotations

import errno
import itertools
import json
import logging
import operator
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from composer.core import State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist

from foundry_fp8.health import plural
from foundry_fp8.jsonl import (
    STEP_RANGE,
    JsonlSink,
    claim_numbered,
    jsonable_metrics,
    lock_writer,
    numbered,
    set_aside,
    unlock_writer,
    write_atomically,
)
from foundry_fp8.jsonl import step as logged_step
from foundry_fp8.options import build
from foundry_fp8.paths import (
    DUMP_FOLDER_KEY,
    EVERY_DUMP,
    in_run_folder,
    run_folder,
    safe_run_name,
    say_repeated,
)

log = logging.getLogger(__name__)

#: the write errors that pass, and what the disk is meanwhile: full (a full disk or quota,
#: freed when a checkpoint is uploaded and deleted or an old one cleaned up) or failing (a
#: network file system's outage: Lustre evicting its client gives EIO, an NFS server restarting
#: ESTALE or ETIMEDOUT, each gone at a later open). Stopping for good at one lost every later
#: record of a run that went on for days; the records meanwhile are held in memory up to
#: HELD_BYTES.
PASSING = {errno.ENOSPC: "full", errno.EDQUOT: "full", errno.EIO: "failing",
           errno.ESTALE: "failing", errno.ETIMEDOUT: "failing"}
HELD_BYTES = 16 * 2**20
#: Seconds between tries of a failing disk (not a full one, which refuses at once and is tried
#: at each record): an open on a soft-mounted NFS in an outage blocks for the mount's timeout
#: (minutes), and Composer logs several times a batch, which would all but stop training.
OUTAGE_RETRY_S = 30.0
#: The clock of those tries (a test's to replace).
_now = time.monotonic


class JSONLLogger(LoggerDestination):
    """Registered as `jsonl` in LLM-Foundry's loggers: `loggers: {jsonl: {path: ...}}`.

    `path` may contain `{run_name}`; it is checked here, when LLM-Foundry builds the logger. A
    relative `path` is taken inside the run folder (`state_run_folder`) and may not lead out of
    it; an absolute one is used as written. One that begins with the run folder itself (the old
    default `runs/{run_name}/metrics.jsonl` written out) names the file it named when relative
    paths were taken in the working directory, with one warning (`paths.say_repeated`).
    Hyperparameters go to `hparams.json` beside it. Only global rank 0 writes, as W&B and
    MLflow do: Composer sends every rank's metrics to every destination, and several ranks
    appending to one file would interleave copies.

    A fresh run (at batch 0 when it starts fitting, or evaluating in a Trainer that never fits)
    starts a new file: the records an earlier
    run of the same name left in it (and its `hparams.json`) are moved to the next free
    `metrics.<n>.jsonl` (`hparams.<n>.json`), with one warning naming both paths, so the report
    never mixes two runs. A resumed run (autoresume, a `load_path` with its timestamp) goes on
    appending (a weights-only load starts at batch 0: a fresh run); the report reads a step
    going back in the file as a later attempt, whose records replace what earlier attempts
    logged from that step on. Composer loads a checkpoint after INIT, so which one it is is
    only known at FIT_START; what this run logged before is kept in the new file.

    Rank 0 holds an advisory lock (flock) on the file from INIT to FIT_END (and from each later
    FIT_START to its FIT_END; a record logged between two fits takes it for that write only),
    and gives it back at `close`; the OS drops it when the process dies. So a resumed run takes
    it again after a killed one, and after a finished one whose Trainer was kept unclosed
    (LLM-Foundry's `train()` returns it so, in a notebook). A second process
    writing the same file at once (the same run name started twice, a relaunch while the old
    job still runs) would interleave two runs' records: it finds the lock taken, warns once
    naming the path and the other writer, and writes the next free `metrics.<n>.jsonl` (and
    `hparams.<n>.json`) instead; `strict: true` raises.
    `hparams.json` is replaced in one step (`jsonl.write_atomically`), so a kill mid-write
    leaves the previous one whole.

    Composer does not guard its logger destinations, so a failure here would end the run. A
    folder that cannot be created or a file that cannot be written (at INIT or mid-run: full
    disk, a folder in the file's place) is logged once, naming the path and the OS error, and
    the logger stops writing while training goes on; `strict: true` raises instead. A full
    disk or quota, or a network file system's outage (`PASSING`), is said once too, but the
    records are held in memory (up to `HELD_BYTES`) and written, in order, at the first record
    that can be written again, which is said with what was lost; `hparams.json` is written again then too. A file
    removed, moved or cut while the run writes it (by hand, or moved aside by another run of
    the same name starting fresh) is warned about, naming the last step it lost, and written on.
    """

    def __init__(self, **options: Any):
        self.options = build("jsonl", options)  # one line naming loggers.jsonl.<key>
        self.path_template: str = self.options.path
        self.strict: bool = self.options.strict
        # the metrics file, resolved at INIT on every rank (only rank 0 writes it): its folder
        # is where every rank's other files go (fp8_stats' dumps, one file per rank)
        self.path: Path | None = None
        self.sink: JsonlSink | None = None  # rank 0's file (set even once writing stopped)
        self.stopped = False  # a write failed: nothing more is written
        self._pending_hparams: dict[str, Any] = {}
        # what an earlier run left: the bytes of the metrics file and hparams.json's text, set
        # aside at FIT_START where this run turns out to be fresh (None: decided)
        self._earlier: tuple[int, str | None] | None = None
        self._own_records = False  # those records are this logger's own (`init`)
        self._last_step: int | None = None  # the step of the last record written
        self._hparams: Path | None = None  # hparams.json, or hparams.<n>.json beside metrics.<n>
        self._lock: tuple[int, int] | None = None  # `jsonl.lock_writer`'s key while held
        self._run_name = ""
        self._state: State | None = None  # the step of a record logged without one
        self._said_bad_step = False  # a record dropped for its step is said once
        self._between_fits = False  # FIT_END gave the lock back: take it again to write
        self._said_no_locks = False  # the "takes no locks" line is said once
        # a full disk (`PASSING`): the records not written yet, their JSON's size, those dropped
        # past HELD_BYTES counted with their first and last step (not each step: a disk may stay
        # full for days), and whether hparams.json is behind
        self._held: deque[tuple[int, dict[str, Any], int]] = deque()
        self._held_bytes = 0
        self._dropped: tuple[int, int, int] | None = None  # (count, first step, last step)
        self._hparams_behind = False
        self._disk = "full"  # `PASSING`'s word for what holds the records back
        self._retry_at = 0.0  # a failing disk is not tried before (`OUTAGE_RETRY_S`)

    def init(self, state: State, logger: Logger) -> None:
        del logger
        folder = state_run_folder(state)
        self.path = in_run_folder(self.path_template, folder, state.run_name,
                                  "loggers.jsonl.path", file=True)
        if dist.get_global_rank() != 0:
            return
        say_repeated(self.path_template, folder, state.run_name, "loggers.jsonl.path")
        # the file still as this logger left it in an earlier Trainer: LLM-Foundry's eval of
        # several models gives each model's Trainer the same loggers (command_utils/eval.py)
        self._own_records = self.sink is not None and self.sink.path == self.path \
            and self.sink.unchanged()
        sink = self.sink = JsonlSink(self.path)
        self._run_name, self._state = state.run_name, state
        self._between_fits = False  # a logger used again in a new Trainer: held from here
        self._hparams = self.path.with_name("hparams.json")
        # now, not at the first metric: say so before training
        self._guard(lambda: self._take(sink, state.run_name), sink.path)
        self._earlier = _earlier_run(sink.path, self._hparams)
        if self._pending_hparams:
            self.log_hyperparameters({})

    def _take(self, sink: JsonlSink, run_name: str) -> None:
        """Create the file and take its lock; where another process holds it, warn and move
        to the next free `metrics.<n>.jsonl` (`strict`: raise)."""
        self._release()
        path = sink.path
        path.parent.mkdir(parents=True, exist_ok=True)
        held = lock_writer(path)
        if isinstance(held, str):
            said = (f"jsonl logger: {path} is being written by {held} (a run named {run_name!r} "
                    "started twice at once, or relaunched while it still runs)")
            if self.strict:
                raise RuntimeError(said)
            assert self._hparams is not None
            n = claim_numbered(path, self._hparams)
            sink.path, self._hparams = numbered(path, n), numbered(self._hparams, n)
            sink.last_file = None  # a new file of ours (mid-run: after a fit), none taken from us
            held = lock_writer(sink.path)
            log.warning("%s; this run writes %s instead, so neither run's records mix with the "
                        "other's (loggers.jsonl.strict: true makes this an error)", said,
                        sink.path)
        elif held is None and not self._said_no_locks:
            self._said_no_locks = True
            log.info("jsonl logger: %s's file system takes no locks: a second run writing it at "
                     "once would not be noticed", path)
        self._lock = held if isinstance(held, tuple) else None

    def _relock(self, path: Path) -> None:
        """Hold the lock of `path` (the new file taking the metrics file's place) instead."""
        held = lock_writer(path)
        self._release()
        self._lock = held if isinstance(held, tuple) else None

    def _release(self) -> None:
        if self._lock is not None:
            unlock_writer(self._lock)
            self._lock = None

    def fit_end(self, state: State, logger: Logger) -> None:
        """The file's lock is given back: LLM-Foundry's `train()` returns its Trainer
        unclosed (llmfoundry/command_utils/train.py:647-650, `trainer.fit()` then `return
        trainer`), and a resume of the run in another process must not find the file taken."""
        del state, logger
        self._release()
        self._between_fits = True

    def close(self, state: State, logger: Logger) -> None:
        """The file's lock is given back (Composer's `Trainer.close`, or at exit), after a last
        try at the records a full disk held (`PASSING`)."""
        del state, logger
        if self.sink is not None and not self.stopped and (self._held or self._hparams_behind):
            sink = self.sink
            self._guard(lambda: self._locked(lambda: self._catch_up(sink)), sink.path)
            self._give_up_held(f"the Trainer closed with the disk still {self._disk}")
        self._release()
        self._between_fits = False

    def _locked(self, call: Callable[[], object]) -> None:
        """`call` with the lock held: between two fits, taken again for it (with `_take`'s
        check for another writer) and given back after."""
        if not self._between_fits:
            call()
            return
        assert self.sink is not None
        self._take(self.sink, self._run_name)
        try:
            call()
        finally:
            self._release()

    def fit_start(self, state: State, logger: Logger) -> None:
        """A fresh run moves an earlier run's records aside (class doc); once per `init`."""
        del logger
        if self._between_fits and self.sink is not None and not self.stopped:
            sink = self.sink
            self._guard(lambda: self._take(sink, state.run_name), sink.path)
        self._between_fits = False
        self._start(state)

    def eval_standalone_start(self, state: State, logger: Logger) -> None:
        """An evaluation-only Trainer (`llmfoundry eval`, a `trainer.eval()` before any fit)
        never fits: it starts here. Under a trained run's name it is a fresh run too, else its
        records (step 0) went after the training's, which the report then read as an attempt
        replacing them all, and the training's hparams.json was lost. The records this logger
        wrote itself in an earlier Trainer (the models of one `llmfoundry eval`) stay."""
        del logger
        if self._own_records:  # the evaluation of an earlier model: one file for them all
            self._earlier = None
        self._start(state)

    def _start(self, state: State) -> None:
        """Where this run is fresh (at batch 0), move the earlier run's records aside."""
        earlier, self._earlier = self._earlier, None
        if (earlier is None or not earlier[0] or self.sink is None or self.stopped
                or int(state.timestamp.batch) != 0):
            return
        path = self.sink.path
        hparams = self._hparams
        assert hparams is not None
        aside = path
        try:
            n = claim_numbered(path, hparams)
            aside, hparams_aside = numbered(path, n), numbered(hparams, n)
            set_aside(path, earlier[0], aside, self._relock)
            self.sink.last_file = None  # our own new file, not one taken from us
        except Exception as e:
            if self.strict:
                raise
            log.warning("jsonl logger: cannot move an earlier run's records from %s to %s (%s); "
                        "this run appends to them (loggers.jsonl.strict: true makes this an "
                        "error)", path, aside, _reason(e))
            return
        hparams_text, dumps = earlier[1], ""
        if hparams_text is not None:
            hparams_text, dumps, failed = _dumps_aside(hparams_text, path.parent, n)
            text = hparams_text  # the record of whatever moved, written first: strict or not
            self._guard(lambda: write_atomically(hparams_aside, text), hparams_aside)
            if failed is not None:
                if self.strict:
                    raise failed
                log.warning("jsonl logger: cannot move all of an earlier run's fp8_stats dumps "
                            "aside (%s); this run's dumps replace those left of the same steps "
                            "(loggers.jsonl.strict: true makes this an error)", _reason(failed))
        log.warning("jsonl logger: %s held the records of an earlier run named %r; this run "
                    "starts at batch 0, so they were moved to %s%s and %s holds this run's "
                    "records only", path, state.run_name, aside,
                    f" (its hparams.json to {hparams_aside.name}{dumps})"
                    if hparams_text is not None else "", path.name)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self.sink is not None and not self.stopped:
            sink, at = self.sink, self._step(step)
            if at is None:
                return
            behind = self._held or self._hparams_behind
            if behind and self._disk == "failing" and _now() < self._retry_at:
                self._hold(at, metrics)
                return
            self._guard(lambda: self._locked(
                lambda: self._catch_up(sink, (at, metrics)) if behind
                else self._write(sink, at, metrics)), sink.path, (at, metrics))

    def _step(self, step: Any) -> int | None:
        """The step a record is written at: None means the current batch, as Composer's own
        Logger.log_metrics fills it in (composer/loggers/logger.py); None where the reader
        (`jsonl.step`) would refuse the file for it, the record dropped and said once."""
        if step is None and self._state is not None:
            return int(self._state.timestamp.batch)
        try:
            at = logged_step(operator.index(step))
        except TypeError:
            at = None
        if at is None and not self._said_bad_step:
            self._said_bad_step = True
            log.warning("jsonl logger: a record at step %r not written to %s: its steps are %s "
                        "(its reader refuses the file otherwise); later such records are dropped "
                        "too, unsaid", step, self.sink and self.sink.path, STEP_RANGE)
        return at

    def _hold(self, step: int, metrics: dict[str, Any]) -> None:
        """Keep a record the full disk refused, to write when it can (`HELD_BYTES` at most).
        Held as written: a tensor's numbers as they are now (a caller may change it in place
        later), counted whole (its str() shows a few of them) and no GPU memory held."""
        metrics = jsonable_metrics(metrics)
        size = len(json.dumps(metrics))
        if self._held_bytes + size > HELD_BYTES:
            count, first, _ = self._dropped or (0, step, step)
            self._dropped = (count + 1, first, step)
            return
        self._held.append((step, metrics, size))
        self._held_bytes += size

    def _catch_up(self, sink: JsonlSink, record: tuple[int, dict[str, Any]] | None = None
                  ) -> None:
        """Write the held records in order (each leaves the queue once written: a full disk
        again keeps the rest), hparams.json if it is behind, then `record` (held by `_guard`
        where this fails before it is written); say so once all are out."""
        held = (len(self._held), self._held[0][0], self._held[-1][0]) if self._held else None
        while self._held:
            step, metrics, size = self._held[0]
            self._write(sink, step, metrics)
            self._held.popleft()
            self._held_bytes -= size
        if self._hparams_behind:
            self._write_hparams()
            self._hparams_behind = False
        if record is not None:
            self._write(sink, *record)
        dropped, self._dropped = self._dropped, None
        log.warning("jsonl logger: %s is written again after %s: %s%s", sink.path,
                    "a full disk" if self._disk == "full" else "its write errors",
                    f"the {held[0]} records held (steps {held[1]} to {held[2]}) are in it"
                    if held else "hparams.json is up to date",
                    f"; {dropped[0]} records of steps {dropped[1]} to {dropped[2]} did not "
                    f"fit in the {HELD_BYTES / 2**20:g} MiB held and are lost" if dropped else "")

    def _give_up_held(self, why: str) -> None:
        """Say what of the held records and hparams.json never reached the disk."""
        if not (self._held or self._dropped or self._hparams_behind):
            return
        count, *ends = self._dropped or (0,)
        steps = [step for step, _, _ in self._held] + ends
        lost = [f"{len(self._held) + count} records of steps {min(steps)} to "
                f"{max(steps)}"] if steps else []
        lost += ["the latest hparams.json"] if self._hparams_behind else []
        log.warning("jsonl logger: %s never reached the disk, which was %s: %s",
                    " and ".join(lost), self._disk, why)
        self._held.clear()
        self._held_bytes, self._dropped, self._hparams_behind = 0, None, False

    def _write(self, sink: JsonlSink, step: int, metrics: dict[str, Any]) -> None:
        """One record; a file removed or taken over since the last one (by hand, or moved aside
        by another run of this name starting fresh) is warned about, once per time it happens,
        and written on."""
        if not sink.write(step, metrics):
            log.warning("jsonl logger: %s was removed, moved or replaced after this run wrote its "
                        "record of step %s (by hand, or by another run of this name starting "
                        "fresh while this one runs); the records up to there are not in it, and "
                        "this run goes on writing to it", sink.path, self._last_step)
        self._last_step = step

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._pending_hparams.update(hyperparameters)
        if self._hparams is not None and not self.stopped:
            if self._held or self._hparams_behind:  # written with the held records
                self._hparams_behind = True
                return
            self._guard(lambda: self._locked(self._write_hparams), self._hparams, hparams=True)

    def _write_hparams(self) -> None:
        assert self._hparams is not None  # where `_take` has put it (hparams.<n>.json)
        write_atomically(self._hparams, json.dumps(self._pending_hparams, indent=2, default=str,
                                                   skipkeys=True))

    def _guard(self, call: Callable[[], object], path: Path,
               record: tuple[int, dict[str, Any]] | None = None, hparams: bool = False) -> None:
        """Run a write; on failure warn once and stop writing (`strict`: raise). A full disk
        (`PASSING`) while writing `record` or `hparams` is said once and they are held, to be
        written once the disk takes them (`_catch_up`); so is an outage's."""
        try:
            call()
        except Exception as e:
            if self.strict:
                raise
            if isinstance(e, OSError) and e.errno in PASSING and (
                    record is not None or hparams or self._held or self._hparams_behind):
                said = self._held or self._hparams_behind
                self._disk = PASSING[e.errno]  # the latest: a full disk, then an outage
                self._retry_at = _now() + OUTAGE_RETRY_S
                if not said:
                    log.warning("jsonl logger: cannot write %s (%s); the records from here on are "
                                "held in memory (up to %g MiB) and written when the disk takes "
                                "them again (said then), training goes on (loggers.jsonl.strict: "
                                "true makes this an error)", path, _reason(e, path),
                                HELD_BYTES / 2**20)
                if record is not None:
                    self._hold(*record)
                self._hparams_behind |= hparams
                return
            self.stopped = True
            log.warning("jsonl logger: cannot write %s (%s); it writes nothing more to %s, "
                        "training goes on (loggers.jsonl.strict: true makes this an error)",
                        path, _reason(e, path), path.parent)
            self._give_up_held("lost")


def _reason(error: Exception, path: Path | None = None) -> str:
    """An error in a few words: an OSError's own text, else its repr; first, the regular file in
    the place of a folder of `path`, which the OS calls only "File exists" or "Not a directory"."""
    if isinstance(error, OSError):
        said = f"{type(error).__name__}: {error.strerror or error}"
        blocking = next((p for p in (path.parents if path is not None else ())
                         if p.is_file()), None)
        return f"a parent of it, {blocking}, is a file; {said}" if blocking else said
    return repr(error)


def _earlier_run(path: Path, hparams: Path) -> tuple[int, str | None]:
    """What is already in the run's files before this run writes: the metrics file's size and
    hparams.json's text (None where absent or unreadable: the write that follows says why)."""
    try:
        size = path.stat().st_size if path.is_file() else 0
        text = hparams.read_text(encoding="utf-8") if size and hparams.is_file() else None
    except (OSError, UnicodeDecodeError):
        return 0, None
    return size, text


def _dumps_aside(hparams: str, folder: Path, n: int) -> tuple[str, str, OSError | None]:
    """Move an earlier run's fp8_stats dumps, in the folder its hparams.json records
    (`paths.DUMP_FOLDER_KEY`, relative to `folder`, the metrics file's), into a new folder
    beside them, `<n>/` (`<n>.1/`, ... where that exists: a leftover never receives nor keeps
    them), with its records set aside as `metrics.<n>.jsonl`: the new run writes the same file
    names there, and the earlier run's report read the new ones. Returns hparams.json's text
    with the record naming the new folder (where the report looks first) where anything moved,
    what to say, and the error that stopped the move part-way or before it. The text as it
    was and "" where nothing moved: no record, a folder outside `folder` (an absolute
    `dump_folder`, perhaps shared by other runs), no dump."""
    try:
        params = json.loads(hparams)
    except ValueError:
        return hparams, "", None
    record = params.get(DUMP_FOLDER_KEY) if isinstance(params, dict) else None
    if (not isinstance(record, str) or not record or "\x00" in record
            or PurePosixPath(record).is_absolute() or ".." in PurePosixPath(record).parts):
        return hparams, "", None
    dumps = folder / record
    files = sorted(dumps.glob(EVERY_DUMP))
    if not files:
        return hparams, "", None
    name = next(name for name in itertools.chain([str(n)], (f"{n}.{i}" for i in itertools.count(1)))
                if not (dumps / name).exists())
    aside, moved, failed = dumps / name, 0, None
    try:
        aside.mkdir()
        for file in files:
            os.rename(file, aside / file.name)
            moved += 1
    except OSError as e:
        failed = e
    if not moved:
        return hparams, "", failed
    params[DUMP_FOLDER_KEY] = (PurePosixPath(record) / name).as_posix()
    return (json.dumps(params, indent=2),
            f", its {plural(moved, 'fp8_stats dump')}"
            f"{f' of {len(files)}' if moved < len(files) else ''} to {aside}", failed)


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
