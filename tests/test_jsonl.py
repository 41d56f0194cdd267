"""metrics.jsonl: the writer, the reader's tolerance of a killed run's partial line, and the
`jsonl` logger's checks and failure handling (in a real Composer Trainer)."""

from __future__ import annotations

import json
import logging
import types

import pytest

from foundry_fp8.jsonl import JsonlError, JsonlSink, read_jsonl

RECORDS = [(0, {"loss": 3.0, "fp8/a/weight/cos_sim": 0.999}), (10, {"loss": 2.0}),
           (20, {"loss": 1.0, "fp8/a/weight/mse": float("nan")})]


def _write(path, records=RECORDS):
    sink = JsonlSink(path)
    for step, metrics in records:
        sink.write(step, metrics)
    return path


def _read(path):
    skipped: list[int] = []
    return [(s, {k: "nan" if v != v else v for k, v in m.items()})
            for s, m in read_jsonl(path, skipped)], skipped


EXPECTED = [(s, {k: "nan" if v != v else v for k, v in m.items()}) for s, m in RECORDS]


def test_a_line_cut_short_by_a_killed_run_is_skipped_and_counted(tmp_path):
    path = _write(tmp_path / "metrics.jsonl")
    text = path.read_text()
    path.write_text(text[: len(text) - 10])  # the last record cut in half, no newline
    assert _read(path) == (EXPECTED[:2], [3])


def test_a_resumed_run_appends_on_a_fresh_line(tmp_path):
    path = _write(tmp_path / "metrics.jsonl", RECORDS[:2])
    path.write_text(path.read_text()[:-12])  # killed mid-write: the second record is partial
    _write(path, RECORDS[2:])  # the resumed run appends
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["step"] == 20
    assert _read(path) == ([EXPECTED[0], EXPECTED[2]], [2])


def test_a_record_glued_to_a_partial_line_is_recovered(tmp_path):
    """Files written before the writer's fresh-line fix: partial line + next record on one line."""
    path = _write(tmp_path / "metrics.jsonl")
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][:15] + lines[2])
    assert _read(path) == ([EXPECTED[0], EXPECTED[2]], [2])
    path.write_text(lines[0] + "\0" * 40 + "\n" + lines[2])  # a crash's zero-filled tail
    assert _read(path) == ([EXPECTED[0], EXPECTED[2]], [2])


def test_a_line_the_writer_finishes_while_read_is_not_split_in_two(tmp_path):
    """QA 19: the reader reached the end of the file in the middle of a line the writer then
    finished; readline() gave its tail as a line of its own, and that whole record was lost
    from the middle (both halves skipped). The records read must be the first ones of the file
    as Python's own line splitting of the finished file gives them."""
    path = _write(tmp_path / "metrics.jsonl")
    whole = path.read_text()
    lines = whole.splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][:15])  # the writer is in the middle of line 2

    class Skipped(list):  # the writer goes on just after the reader took line 2's first half
        def append(self, lineno: int) -> None:
            super().append(lineno)
            with path.open("a") as f:
                f.write(lines[1][15:] + lines[2] if len(self) == 1 else "")

    skipped = Skipped()
    read = [step for step, _ in read_jsonl(path, skipped)]
    in_file = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert in_file == [0, 10, 20]
    assert read == in_file[:len(read)]  # was [0, 20]: step 10 lost, lines 2 and 3 skipped
    assert skipped == [2]  # the one line not finished when read
    assert _read(path) == (EXPECTED, [])  # read again once finished: every record


def test_only_the_unfinished_last_line_is_cut_not_a_crash_line_before_it(tmp_path):
    """Review 19: a reader told a line "not finished" only by counting skipped lines, so a
    killed run's partial line in the middle (glued to nothing: the resumed run's writer began a
    new line) passed for the one still being written. `cut` names only the last line, and only
    where it has no newline and yields no record."""
    lines = [json.dumps({"step": s, "metrics": {"loss": 1.0}}) + "\n" for s in range(4)]
    crash = '{"step": 2, "metr\n'  # a kill mid-write; the resumed run's sink added the newline
    path = tmp_path / "metrics.jsonl"
    path.write_text(lines[0] + lines[1] + crash + lines[2] + lines[3][:9])
    split = path.read_text().splitlines(keepends=True)  # Python's own lines: the reference
    assert split[2] == crash and not split[4].endswith("\n")
    skipped: list[int] = []
    cut: list[int] = []
    assert [s for s, _ in read_jsonl(path, skipped, None, cut)] == [0, 1, 2]
    assert (skipped, cut) == ([3, 5], [5])
    path.write_text("".join(lines[:3]) + crash)  # a crash line last, its newline written
    cut.clear()
    assert [s for s, _ in read_jsonl(path, None, None, cut)] == [0, 1, 2] and cut == []


def test_an_over_long_line_the_writer_finishes_while_read_is_one_line(tmp_path, monkeypatch):
    """The same for a line over MAX_LINE_BYTES the file ended inside: skipped once, not its
    tail again as another over-long line."""
    import foundry_fp8.jsonl as jsonl

    line = (json.dumps({"step": 0, "metrics": {"loss": 3.0}}) + "\n").encode()
    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", len(line) - 1, raising=False)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(line + b"\0" * 5000)

    class TooLong(list):  # the writer goes on just after the reader read to the file's end
        def append(self, lineno: int) -> None:
            super().append(lineno)
            with path.open("ab") as f:
                f.write(b"\0" * 5000 + b"\n" + line.replace(b"0,", b"1,") if len(self) == 1
                        else b"")

    skipped: list[int] = []
    too_long = TooLong()
    read = [step for step, _ in read_jsonl(path, skipped, too_long)]
    assert path.read_bytes().count(b"\n") == 3  # three lines in the finished file
    assert read == [0] and skipped == too_long == [2]  # was [2, 3]: one line counted twice


@pytest.mark.parametrize(("content", "message"), [
    ('{"step": 0}\n', "metrics.jsonl:1: not a metrics record (no key 'metrics')"),
    ('{"step": 0, "metrics": {}}\n[1, 2]\n', "metrics.jsonl:2: not a metrics record (an array"),
    ('{"step": 0, "metrics": {}}\n{"step": null, "metrics": {}}\n',
     "metrics.jsonl:2: key 'step': expected a step (an integer from 0 to 2**53), got null"),
    ('{"step": "x", "metrics": {}}\n', "metrics.jsonl:1: key 'step': expected a step (an integer "
     'from 0 to 2**53), got "x"'),
    ('{"step": -1, "metrics": {}}\n', "metrics.jsonl:1: key 'step': expected a step (an integer "
     "from 0 to 2**53), got -1"),
    (f'{{"step": {10**4000}, "metrics": {{}}}}\n', "metrics.jsonl:1: key 'step': expected a step "
     "(an integer from 0 to 2**53), got 1000000000000000000000000000000000000..."),
    ('{"step": 1, "metrics": 5}\n', "metrics.jsonl:1: key 'metrics': expected an object, got 5"),
    ("step,loss\n0,3.0\n", "metrics.jsonl: no metrics record; 2 lines do not decode as JSON"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "metrics.jsonl: no metrics record; 3 lines"),
    ('{"step": 0, "met\n', "metrics.jsonl: no metrics record; 1 line does not decode"),
])
def test_a_file_that_is_not_a_metrics_file_is_still_an_error(tmp_path, content, message):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(JsonlError) as error:
        list(read_jsonl(path))
    assert message in str(error.value) and "\n" not in str(error.value)


# ---- the `jsonl` logger ------------------------------------------------------------------

@pytest.mark.parametrize(("path", "message"), [
    ("runs/{runname}/metrics.jsonl", "has unknown placeholder {runname} (did you mean "
                                     "`run_name`?) (fix: use only {run_name}"),
    ("runs/{}/metrics.jsonl", "has unknown placeholder {} (fix: use only {run_name}"),
    ("runs/{run_name.x}/m.jsonl", "unknown placeholder {run_name.x}"),
    ("runs/{run_name/metrics.jsonl", "expected '}'"),
    (None, "takes str, got null"),
    (5, "takes str, got int 5"),
    ("", "must be a file path, got an empty one"),
    (" ", "must be a file path, got an empty one"),
])
def test_logger_checks_its_path_when_built(path, message):
    from foundry_fp8.composer.jsonl_logger import JSONLLogger

    with pytest.raises(ValueError, match="^loggers.jsonl.path: ") as error:
        JSONLLogger(path=path)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert JSONLLogger(path="runs/{{literal}}/{run_name}.jsonl").path_template
    with pytest.raises(ValueError, match=r"^loggers\.jsonl\.strict: takes bool, got str"):
        JSONLLogger(strict="true")


def _logger(tmp_path, **kwargs):
    from foundry_fp8.composer.jsonl_logger import JSONLLogger

    logger = JSONLLogger(**kwargs)
    logger.init(types.SimpleNamespace(run_name="r"), None)
    return logger


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_logger_with_an_unwritable_folder_warns_once_and_writes_nothing(tmp_path, caplog):
    (tmp_path / "afile").write_text("")
    path = tmp_path / "afile" / "{run_name}" / "metrics.jsonl"  # a file where a folder must be
    logger = _logger(tmp_path, path=str(path))
    logger.log_hyperparameters({"seed": 1})
    logger.log_metrics({"loss": 1.0}, step=0)
    [warning] = _warnings(caplog)
    assert f"cannot write {tmp_path / 'afile' / 'r' / 'metrics.jsonl'}" in warning
    assert "NotADirectoryError" in warning or "FileExistsError" in warning
    assert logger.sink is not None and logger.stopped
    with pytest.raises(OSError):
        _logger(tmp_path, path=str(path), strict=True)


def test_logger_write_failure_mid_run_warns_once_and_stops_writing(tmp_path, caplog):
    logger = _logger(tmp_path, path=str(tmp_path / "{run_name}" / "metrics.jsonl"))
    logger.log_metrics({"loss": 1.0}, step=0)
    file = tmp_path / "r" / "metrics.jsonl"
    file.unlink()
    file.mkdir()  # the file replaced by a folder
    for step in (1, 2):
        logger.log_metrics({"loss": 1.0}, step=step)
    logger.log_hyperparameters({"seed": 1})
    [warning] = _warnings(caplog)
    assert f"cannot write {file} (IsADirectoryError: Is a directory)" in warning
    assert not (tmp_path / "r" / "hparams.json").exists()  # stopped: nothing more is written

    strict = _logger(tmp_path, path=str(tmp_path / "s" / "{run_name}.jsonl"), strict=True)
    (tmp_path / "s" / "r.jsonl").unlink()
    (tmp_path / "s" / "r.jsonl").mkdir()
    with pytest.raises(IsADirectoryError):
        strict.log_metrics({"loss": 1.0}, step=3)


def test_a_file_deleted_or_taken_over_mid_run_is_warned_once(tmp_path, caplog):
    """The metrics file removed mid-run (by hand), or moved aside by a second run of the same
    name starting fresh while this one still writes: the records written before are not in the
    file at the path any more, and the report would read a run starting late, or two runs
    mixed. Writing goes on (into the new file), with one warning naming the last step lost."""
    template = str(tmp_path / "{run_name}" / "metrics.jsonl")
    file = tmp_path / "r" / "metrics.jsonl"
    logger = _logger(tmp_path, path=template)
    for step in (0, 1):
        logger.log_metrics({"loss": 1.0}, step=step)
    file.unlink()
    for step in (2, 3):
        logger.log_metrics({"loss": 1.0}, step=step)
    [warning] = _warnings(caplog)
    assert f"{file} was removed, moved or replaced after this run wrote its record of step 1" \
        in warning
    assert [step for step, _ in read_jsonl(file)] == [2, 3]

    caplog.clear()
    second = _logger(tmp_path, path=template)  # the same run name, started fresh
    second.fit_start(types.SimpleNamespace(run_name="r", timestamp=types.SimpleNamespace(
        batch=0)), None)
    second.log_metrics({"loss": 2.0}, step=0)
    logger.log_metrics({"loss": 1.0}, step=4)
    assert [step for step, _ in read_jsonl(tmp_path / "r" / "metrics.1.jsonl")] == [2, 3]
    assert [step for step, _ in read_jsonl(file)] == [0, 4]  # two runs mixed: said once more
    assert sum("was removed, moved or replaced after this run wrote its record of step 3" in w
               for w in _warnings(caplog)) == 1
    second.log_metrics({"loss": 2.0}, step=1)  # its own file all along: nothing to say
    assert sum("was removed" in w for w in _warnings(caplog)) == 1


def test_hparams_logged_before_init_are_written_at_init(tmp_path):
    from foundry_fp8.composer.jsonl_logger import JSONLLogger

    logger = JSONLLogger(path=str(tmp_path / "{run_name}" / "metrics.jsonl"))
    logger.log_hyperparameters({"seed": 1})
    logger.init(types.SimpleNamespace(run_name="r"), None)
    assert json.loads((tmp_path / "r" / "hparams.json").read_text()) == {"seed": 1}


def _train(tmp_path, logger, callbacks=(), batches=4, **options):
    """A real Composer Trainer on a tiny classifier, CPU, a few batches (`options`: more of
    the Trainer's)."""
    import torch
    from composer import Trainer
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    model = ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2)
    trainer = Trainer(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                      train_dataloader=DataLoader(data, batch_size=4), max_duration=f"{batches}ba",
                      loggers=[logger], callbacks=list(callbacks), run_name="r",
                      progress_bar=False, log_to_console=False,
                      **{"save_folder": None, **options})
    trainer.fit()
    return trainer


def test_training_survives_a_write_failure_in_a_real_trainer(tmp_path, caplog):
    """Composer does not guard logger destinations: an exception there would end the run."""
    from composer.core import Callback

    from foundry_fp8.composer.jsonl_logger import JSONLLogger

    file = tmp_path / "r" / "metrics.jsonl"

    class BreakTheFile(Callback):
        def batch_start(self, state, logger):
            if int(state.timestamp.batch) == 2:
                file.unlink()
                file.mkdir()

    trainer = _train(tmp_path, JSONLLogger(path=str(tmp_path / "{run_name}" / "metrics.jsonl")),
                     [BreakTheFile()])
    assert int(trainer.state.timestamp.batch) == 4
    assert sum("cannot write" in w for w in _warnings(caplog)) == 1


def test_training_survives_an_unwritable_folder_in_a_real_trainer(tmp_path, caplog):
    from foundry_fp8.composer.jsonl_logger import JSONLLogger

    (tmp_path / "afile").write_text("")
    trainer = _train(tmp_path, JSONLLogger(path=str(tmp_path / "afile" / "{run_name}.jsonl")))
    assert int(trainer.state.timestamp.batch) == 4
    assert sum("cannot write" in w for w in _warnings(caplog)) == 1


def _logs_at_init(run: str):
    """A callback logging a metric and a hyperparameter at INIT, before FIT_START, where the
    `jsonl` logger learns whether the run is fresh."""
    from composer.core import Callback

    class LogsAtInit(Callback):
        def init(self, state, logger):
            logger.log_metrics({"early": 1.0}, step=0)
            logger.log_hyperparameters({"run": run})

    return LogsAtInit()


def test_a_fresh_run_of_the_same_name_moves_the_earlier_records_aside(tmp_path, caplog):
    """A new run (batch 0) of a run name used before starts a new metrics.jsonl: the earlier
    run's records and hparams.json go to the next free number, nothing is overwritten, and
    what this run logged before FIT_START stays with it."""
    from foundry_fp8.composer.jsonl_logger import JSONLLogger

    path, folder = str(tmp_path / "{run_name}" / "metrics.jsonl"), tmp_path / "r"
    _train(tmp_path, JSONLLogger(path=path), [_logs_at_init("first")])
    first = (folder / "metrics.jsonl").read_bytes()
    (folder / "metrics.1.jsonl").write_text("someone else's\n")  # taken
    caplog.clear()
    _train(tmp_path, JSONLLogger(path=path), [_logs_at_init("second")])
    assert (folder / "metrics.1.jsonl").read_text() == "someone else's\n"
    assert (folder / "metrics.2.jsonl").read_bytes() == first
    assert json.loads((folder / "hparams.2.json").read_text())["run"] == "first"
    assert json.loads((folder / "hparams.json").read_text())["run"] == "second"
    records = list(read_jsonl(folder / "metrics.jsonl"))
    assert records[0] == (0, {"early": 1.0})
    assert [step for step, m in records if "loss/train/total" in m] == [0, 1, 2, 3]
    [warning] = _warnings(caplog)
    assert f"{folder / 'metrics.jsonl'} held the records of an earlier run named 'r'" in warning
    assert f"moved to {folder / 'metrics.2.jsonl'} (its hparams.json to hparams.2.json)" in warning


def test_a_resumed_run_goes_on_appending(tmp_path, caplog):
    from foundry_fp8.composer.jsonl_logger import JSONLLogger

    path, folder = str(tmp_path / "{run_name}" / "metrics.jsonl"), tmp_path / "r"
    _train(tmp_path, JSONLLogger(path=path), save_folder=str(folder / "checkpoints"),
           save_interval="2ba")
    caplog.clear()
    _train(tmp_path, JSONLLogger(path=path),
           load_path=str(folder / "checkpoints" / "ep0-ba2-rank0.pt"))
    steps = [step for step, m in read_jsonl(folder / "metrics.jsonl") if "loss/train/total" in m]
    assert steps == [0, 1, 2, 3, 2, 3]
    assert sorted(p.name for p in folder.glob("*.json*")) == ["hparams.json", "metrics.jsonl"]
    assert _warnings(caplog) == []


def test_a_kill_mid_write_leaves_hparams_json_whole(tmp_path):
    """The process dies while writing hparams.json (here: past its file size limit, SIGXFSZ,
    as a full disk or a kill mid-write): the previous hparams.json is still whole."""
    import signal
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    code = textwrap.dedent(f"""
        import resource, signal, types
        from foundry_fp8.composer.jsonl_logger import JSONLLogger
        logger = JSONLLogger(path={str(tmp_path / "metrics.jsonl")!r})
        logger.init(types.SimpleNamespace(run_name="r"), None)
        logger.log_hyperparameters({{"seed": 1}})
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it: die, as killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        logger.log_hyperparameters({{"big": "x" * 100_000}})
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGXFSZ, done.stderr[-2000:]
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"seed": 1}


# ---- a line with no end (QA finding 4) ---------------------------------------------------

_BOUNDED_READ = """
import resource, sys
from foundry_fp8.jsonl import read_jsonl
_, hard = resource.getrlimit(resource.RLIMIT_AS)
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + 400 * 2**20, hard))  # 400 MiB more, no more
skipped: list[int] = []
print([step for step, _ in read_jsonl(sys.argv[1], skipped)], skipped)
"""


def test_a_gigabyte_line_of_nuls_is_skipped_in_bounded_memory(tmp_path):
    """What a power loss can leave in a file (a run of NULs with no newline) is read through in
    bounded chunks and skipped, not read whole into memory (1 GiB here, under a 400 MiB limit)."""
    import subprocess
    import sys

    path = _write(tmp_path / "metrics.jsonl", RECORDS[:1])
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size + 2**30)  # a sparse gigabyte of NULs
    _write(path, RECORDS[1:])  # a resumed run appends after it, on a fresh line
    done = subprocess.run([sys.executable, "-c", _BOUNDED_READ, str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "[0, 10, 20] [2]\n"


def test_a_line_over_the_cap_is_skipped_and_named(tmp_path, monkeypatch):
    """Over MAX_LINE_BYTES a line is no record of ours: skipped as a line that does not decode,
    and named as too long; a line just at the cap still reads."""
    import foundry_fp8.jsonl as jsonl

    line = (json.dumps({"step": 0, "metrics": {"loss": 3.0}}) + "\n").encode()
    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", len(line) - 1, raising=False)
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(line + b"\0" * 5000 + b"\n" + line.replace(b"0,", b"1,"))
    skipped: list[int] = []
    too_long: list[int] = []
    assert [s for s, _ in read_jsonl(path, skipped, too_long)] == [0, 1]
    assert skipped == [2] and too_long == [2]
    path.write_bytes(b"\0" * 5000)
    with pytest.raises(JsonlError, match=r"no metrics record; 1 line does not decode as JSON "
                                         rf"\(line 1: longer than {len(line) - 1:,} bytes\)"):
        list(read_jsonl(path))


# ---- two processes writing one run's file at once (QA session 16) ------------------------

_WRITER = """
import logging, os, sys, types
from foundry_fp8.composer.jsonl_logger import JSONLLogger
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
path, name, batch, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
strict = how == "strict"
logger = JSONLLogger(path=path, strict=strict)
logger.log_hyperparameters({"run": name})
logger.init(types.SimpleNamespace(run_name="r"), None)
logger.fit_start(types.SimpleNamespace(run_name="r", timestamp=types.SimpleNamespace(
    batch=batch)), None)
for step in range(batch, batch + 2):
    logger.log_metrics({"writer": name}, step=step)
if how == "fork" and os.fork() == 0:  # a child (a DataLoader worker) outliving its parent
    sys.stdin.read()
    os._exit(0)
print("ready", flush=True)
if sys.stdin.readline():  # the test says go on; at end of input (killed or told to stop): no
    for step in range(batch + 2, batch + 4):
        logger.log_metrics({"writer": name}, step=step)
"""


def _writer(path, name: str, batch: int = 0, how: str = "lax"):
    """A real second process running the `jsonl` logger on `path`: starts (batch `batch`),
    logs two steps, says "ready" and waits; a line on its stdin makes it log two more. `how`:
    `strict` (loggers.jsonl.strict: true), `fork` (it forks a child waiting for stdin's end)."""
    import subprocess
    import sys
    from pathlib import Path

    return subprocess.Popen([sys.executable, "-c", _WRITER, str(path), name, str(batch),
                             how], cwd=Path(__file__).parents[1],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _ready(process) -> None:
    line = process.stdout.readline()
    if line != "ready\n":
        process.kill()
        raise AssertionError(process.communicate()[1][-2000:])


def test_a_second_process_writing_the_same_file_at_once_writes_its_own(tmp_path):
    """Two runs of one name at once (a relaunch while the old job still runs): before, the
    second moved the first one's records aside and both appended to metrics.jsonl, which the
    report read as one run whose steps go back many times. Now the second finds the file locked,
    says so in one line naming the first's pid, and writes metrics.1.jsonl; `strict` raises."""
    path = tmp_path / "metrics.jsonl"
    first = _writer(path, "first")
    try:
        _ready(first)
        second = _writer(path, "second")
        _ready(second)
        _, second_err = second.communicate("go\n", timeout=300)
        strict = _writer(path, "strict", how="strict")
        _, strict_err = strict.communicate("", timeout=300)
        first.communicate("go\n", timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0 and second.returncode == 0, second_err[-2000:]
    writers = {name: [(s, m["writer"]) for s, m in read_jsonl(tmp_path / name)]
               for name in ("metrics.jsonl", "metrics.1.jsonl")}
    assert writers == {"metrics.jsonl": [(s, "first") for s in range(4)],
                       "metrics.1.jsonl": [(s, "second") for s in range(4)]}
    assert json.loads((tmp_path / "hparams.json").read_text()) == {"run": "first"}
    assert json.loads((tmp_path / "hparams.1.json").read_text()) == {"run": "second"}
    [warning] = second_err.splitlines()
    assert warning.startswith(f"WARNING jsonl logger: {path} is being written by pid "
                              f"{first.pid} ")
    assert f"this run writes {tmp_path / 'metrics.1.jsonl'} instead" in warning
    assert strict.returncode == 1
    assert (f"RuntimeError: jsonl logger: {path} is being written by pid {first.pid} "
            in strict_err)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hparams.1.json", "hparams.json", "metrics.1.jsonl", "metrics.jsonl"]


@pytest.mark.parametrize("how", ["lax", "fork"])
def test_a_run_resumed_after_its_killed_attempt_appends_without_a_warning(tmp_path, caplog,
                                                                            how):
    """The OS drops a killed process's lock: the resumed run takes the file again, also while
    a child it forked (a DataLoader worker) still lives."""
    import signal

    path = tmp_path / "metrics.jsonl"
    killed = _writer(path, "killed", how=how)
    _ready(killed)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(timeout=300) == -signal.SIGKILL
    resumed = _logger(tmp_path, path=str(path))
    resumed.fit_start(types.SimpleNamespace(run_name="r", timestamp=types.SimpleNamespace(
        batch=1)), None)
    for step in (1, 2):
        resumed.log_metrics({"writer": "resumed"}, step=step)
    resumed.close(None, None)
    killed.stdin.close()  # the child, if any, ends
    killed.stdout.close()
    killed.stderr.close()
    assert [(s, m["writer"]) for s, m in read_jsonl(path)] == [
        (0, "killed"), (1, "killed"), (1, "resumed"), (2, "resumed")]
    assert _warnings(caplog) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hparams.json", "metrics.jsonl"]


def test_a_kept_trainer_gives_the_lock_back_at_fit_end(tmp_path, caplog):
    """LLM-Foundry's `train()` returns its Trainer unclosed: kept in a notebook, it held the
    lock, and a resume of the run from another process went to metrics.1.jsonl with a warning.
    Now FIT_END gives the lock back; a second fit() here takes it again and appends, and finds
    another process holding it as the first INIT would."""
    from foundry_fp8.composer.jsonl_logger import JSONLLogger

    path = tmp_path / "metrics.jsonl"
    trainer = _train(tmp_path, JSONLLogger(path=str(path)))  # fit, kept, not closed
    resumed = _writer(path, "resumed", batch=4)
    _, resumed_err = resumed.communicate("go\n", timeout=300)
    assert resumed.returncode == 0 and resumed_err == ""
    trainer.fit(duration="2ba")  # a second fit of the kept Trainer, here
    holder = _writer(path, "holder", batch=10)
    try:
        _ready(holder)
        caplog.clear()
        trainer.fit(duration="1ba")
    finally:
        holder.communicate("", timeout=300)
    trainer.close()
    losses = [(s, m.get("writer")) for s, m in read_jsonl(path)
              if "loss/train/total" in m or "writer" in m]
    assert losses == [(0, None), (1, None), (2, None), (3, None), (4, "resumed"), (5, "resumed"),
                      (6, "resumed"), (7, "resumed"), (4, None), (5, None), (10, "holder"),
                      (11, "holder")]
    [warning] = _warnings(caplog)
    assert warning.startswith(f"jsonl logger: {path} is being written by pid {holder.pid} ")
    assert [s for s, m in read_jsonl(tmp_path / "metrics.1.jsonl")
            if "loss/train/total" in m] == [6]


_WITHOUT_POSIX = """
import importlib.metadata, logging, os, random, subprocess, sys, types
import composer.core  # it, torch and these need a POSIX os or check for Windows themselves
sys.modules["fcntl"] = None  # as on Windows: `import fcntl` fails
for name in ("register_at_fork", "major", "minor", "O_CLOEXEC", "O_NONBLOCK"):
    delattr(os, name)
logging.basicConfig(format="%(levelname)s %(message)s")
logging.getLogger("foundry_fp8").setLevel(logging.INFO)
import foundry_fp8.lint.cli, foundry_fp8.report.cli
from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.jsonl import read_jsonl
logger = JSONLLogger(path=sys.argv[1])
logger.init(types.SimpleNamespace(run_name="r"), None)
logger.fit_start(types.SimpleNamespace(run_name="r", timestamp=types.SimpleNamespace(batch=0)),
                 None)
logger.log_metrics({"loss": 2.5}, step=0)
logger.fit_end(None, None)
logger.log_metrics({"loss": 1.5}, step=1)
logger.close(None, None)
print(list(read_jsonl(sys.argv[1])))
"""


def test_the_cli_and_the_logger_work_without_fcntl(tmp_path):
    """Windows has no fcntl, os.register_at_fork nor os.major: `import fcntl` at the top of
    jsonl.py stopped `foundry-fp8 lint` and `report` from starting there. Now the logger writes
    without a lock, saying so once."""
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "metrics.jsonl"
    done = subprocess.run([sys.executable, "-c", _WITHOUT_POSIX, str(path)], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "[(0, {'loss': 2.5}), (1, {'loss': 1.5})]\n"
    ours = [line for line in done.stderr.splitlines() if "jsonl logger" in line]
    assert ours == [f"INFO jsonl logger: {path}'s file system takes no locks: a second run "
                    "writing it at once would not be noticed"]


def test_a_fifo_in_place_of_the_file_is_refused_not_waited_on(tmp_path):
    """Opening a FIFO to write waits for a reader forever: the run hung at INIT. Now one warning
    names it and the logger writes nothing more while the run goes on; `strict` raises."""
    import os

    path = tmp_path / "metrics.jsonl"
    os.mkfifo(path)
    said = (f"jsonl logger: cannot write {path} (FileExistsError: a FIFO (named pipe), not a "
            "regular file: remove it, or write elsewhere)")
    for how in ("lax", "strict"):
        run = _writer(path, how, how=how)
        try:
            out, err = run.communicate("go\n", timeout=120)  # a hang guard, no timing assert
        finally:
            run.kill()
        if how == "lax":
            assert (run.returncode, out) == (0, "ready\n")
            assert err.splitlines() == [f"WARNING {said}; it writes nothing more to {tmp_path}, "
                                        "training goes on (loggers.jsonl.strict: true makes this "
                                        "an error)"]
        else:
            assert run.returncode == 1 and "a FIFO (named pipe), not a regular file" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
