"""`foundry-fp8 report` on real-shaped inputs QA session 27 found mishandled: a run folder the
report may not write (said in one line before the run is read, not after minutes of reading), a
`.wandb` file joined from several runs (another run's numbers were reported as this run's), and a
JSONL file with a UTF-8 byte order mark or a number Python will not convert (blamed on a kill)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

import foundry_fp8.report.cli as report_cli
from foundry_fp8.cli import main
from foundry_fp8.health import layer_key
from foundry_fp8.wandb_history import WandbRun, scan
from tests.test_report import L1, write_run

UNDERFLOW_L1 = layer_key("underflow_pct", "gradient", L1)


@pytest.mark.parametrize("baseline", [False, True], ids=["alone", "with-baseline"])
def test_a_read_only_run_folder_is_said_before_the_run_is_read(tmp_path, capsys, monkeypatch,
                                                                baseline):
    """The run folder refuses new files as a read-only mount does (EROFS: root, who ignores
    chmod, is refused too); the report says so in one line, with `--out`, before reading the run
    or the baseline (a long run's read takes minutes), and writes nothing."""
    folder = write_run(tmp_path / "run")
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).parent == folder:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    read: list[Path] = []
    monkeypatch.setattr(os, "open", read_only)
    monkeypatch.setattr(report_cli, "load", lambda given, *a: read.append(given))
    monkeypatch.setattr(report_cli, "read_baseline", lambda given: read.append(given))
    args = ["report", str(folder)] + (["--baseline", str(folder)] if baseline else [])
    assert main(args) == 2
    out = capsys.readouterr()
    assert out.err == (f"error: {folder}: cannot write the report there (Read-only file system); "
                       "--out DIR writes the report elsewhere\n"), out.err
    assert not read and sorted(p.name for p in folder.iterdir()) == ["metrics.jsonl"]


def test_out_into_a_read_only_folder_is_said_before_the_run_is_read(tmp_path, capsys,
                                                                     monkeypatch):
    """`--out` not there yet, inside a folder that refuses new files: judged by that folder."""
    folder, locked = write_run(tmp_path / "run"), tmp_path / "locked"
    locked.mkdir()
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).parent == locked:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    monkeypatch.setattr(report_cli, "load", lambda *a: pytest.fail("the run was read"))
    assert main(["report", str(folder), "--out", str(locked / "new")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {locked / 'new'}: cannot write the report there (Permission denied)\n"


def test_the_probe_leaves_nothing_in_a_writable_folder(tmp_path, capsys):
    write_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def _records(path: Path, runs: list[tuple[str, list[int], float]]) -> Path:
    """A `.wandb` file holding, one after the other, each run's run record (its id and config,
    as wandb-core writes it first), history rows and exit record: what joining run files
    (W&B writes one run per file) leaves."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    path.parent.mkdir(parents=True, exist_ok=True)
    store = DataStore()
    store.open_for_write(str(path))
    for run_id, steps, underflow in runs:
        record = wandb_internal_pb2.Record()
        record.run.run_id = run_id
        record.run.config.update.add(key="run_name", value_json=json.dumps(run_id))
        store.write(record)
        for step in steps:
            record = wandb_internal_pb2.Record()
            record.history.step.num = step
            for key, value in {UNDERFLOW_L1: underflow + step, "loss/train/total": 3.0,
                               "_step": step}.items():
                record.history.item.add(key=key, value_json=json.dumps(value))
            store.write(record)
        record = wandb_internal_pb2.Record()
        record.exit.exit_code = 0
        store.write(record)
    store.close()
    return path


def test_another_runs_records_after_the_exit_record_are_not_this_runs(tmp_path, capsys):
    """Before: run 'def456''s numbers (50 % underflow from its step 0) replaced run 'abc123''s
    as a resume's would, with the steps-go-back warning alone; its config merged in too."""
    path = _records(tmp_path / "wandb" / "offline-run-20261130_000000-abc123" / "run-abc123.wandb",
                    [("abc123", [0, 1, 2], 1.0), ("def456", [0, 1, 2], 50.0)])
    run = WandbRun(path)
    assert [row["_step"] for row in scan(run)] == [0, 1, 2]
    assert (run.run_id, run.joined, run.complete, run.config) == (
        "abc123", "def456", True, {"run_name": "abc123"})
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr()
    assert out.err == (f"warning: {path}: the records of run 'def456' follow those of run "
                       "'abc123' in this file (W&B writes one run per file: it was joined from "
                       "several); the report covers run 'abc123' alone, report 'def456' from its "
                       "own file\n"), out.err
    assert f"| {L1} | gradient | 3 |" in out.out  # abc123's worst, 1 + 2; not def456's 52


def test_the_same_runs_next_attempt_after_its_exit_record_is_read_and_said(tmp_path, capsys):
    """Read on, as `wandb sync` sends it; one line says the file is not as W&B writes it."""
    path = _records(tmp_path / "run-abc123.wandb",
                    [("abc123", [0, 1, 2], 1.0), ("abc123", [3, 4], 1.0)])
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr()
    assert out.err == (f"warning: {path}: another attempt of run 'abc123' follows its exit "
                       "record in this file (W&B writes each attempt to a file of its own: it was "
                       "joined); read as a later attempt, as `wandb sync` sends it\n"), out.err
    assert f"| {L1} | gradient | 5 |" in out.out


def test_a_byte_order_mark_at_the_start_is_read_past(tmp_path, capsys):
    """An editor's or PowerShell's UTF-8 save: its first line (step 0) was skipped as a killed
    run's, with a warning blaming a kill; `json.loads` reads it on bytes."""
    path = write_run(tmp_path) / "metrics.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    assert "3 logging steps (0 to 20)" in (tmp_path / "fp8_report.md").read_text()


def test_a_number_python_will_not_convert_is_named_not_blamed_on_a_kill(tmp_path, capsys):
    """5,000 digits: past CPython's 4,300-digit guard on int() (json raises ValueError, not a
    JSONDecodeError); the line is skipped and the warning says why, not 'killed mid-write'."""
    path = write_run(tmp_path) / "metrics.jsonl"
    with path.open("a") as f:
        f.write(f'{{"step": 30, "metrics": {{"{UNDERFLOW_L1}": {"1" * 5000}}}}}\n')
        f.write('{"step": 40, "metrics": {"x": 1.0}}\n{"step": 50, "metri')  # and a cut line
    assert main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().err == (
        f"warning: {path}:4: skipped 2 lines that do not decode (line 4, 6; a run killed "
        "mid-write leaves one; line 4: a number of 5,000 digits, more than the 4,300 Python's "
        "int() reads (no logger writes one)); the report covers the rest\n")
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:4]))
    assert main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().err == (
        f"warning: {path}:4: skipped 1 line that does not decode (line 4: a number of 5,000 "
        "digits, more than the 4,300 Python's int() reads (no logger writes one)); the report "
        "covers the rest\n")


def test_a_folder_without_metrics_jsonl_names_the_jsonl_files_it_holds(tmp_path, capsys):
    """A `loggers.jsonl.path` of another name, or one run folder per rank or node side by side:
    the line named no file, and asked whether the `jsonl` logger was in the YAML."""
    write_run(tmp_path / "node1")
    write_run(tmp_path / "node0")
    (tmp_path / "fp8.jsonl").write_bytes((tmp_path / "node0" / "metrics.jsonl").read_bytes())
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'metrics.jsonl'}: not found; it holds fp8.jsonl, node0/metrics.jsonl"
        f", node1/metrics.jsonl: name one, e.g. foundry-fp8 report {tmp_path / 'fp8.jsonl'}\n")
    assert main(["report", str(tmp_path / "fp8.jsonl")]) == 0


def test_a_run_whose_fp8_values_are_all_nan_is_not_called_healthy(tmp_path, capsys):
    """fp8_stats logs a NaN statistic only beside the NaN/Inf count that made it; every value NaN,
    the counts too, was judged nowhere. Before: 'No layer crosses a threshold.' and 'perfect
    everywhere' for every statistic."""
    path = write_run(tmp_path) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "metrics": {
        k: "nan" if k.startswith("fp8_") else v for k, v in r["metrics"].items()}}) + "\n"
        for r in records))
    assert main(["report", str(tmp_path)]) == 0
    said = "No layer judged: every value of underflow_pct, overflow_pct, rel_mse, cos_sim, "
    assert f"0 flagged\n  {said}" in capsys.readouterr().out
    markdown = (tmp_path / "fp8_report.md").read_text()
    assert said in markdown and "No layer crosses" not in markdown
    assert "- **underflow_pct**: NaN at every logged step, judged nowhere" in markdown
    assert "perfect everywhere" not in markdown


@pytest.mark.parametrize("given", ["folder", "file"])
def test_a_utf16_copy_is_named_so(tmp_path, capsys, given):
    """PowerShell's `>` writes UTF-16 with a byte order mark: before, the folder's line quoted
    a UnicodeDecodeError at byte 0xff."""
    path = write_run(tmp_path) / "metrics.jsonl"
    path.write_bytes(path.read_text().replace("\n", "\r\n").encode("utf-16"))
    assert main(["report", str(tmp_path if given == "folder" else path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {path}: UTF-16 text (a copy made through PowerShell's `>` or `Out-File` is), not "
        "the UTF-8 the `jsonl` logger writes: report the run's own metrics.jsonl, or convert this "
        "one (iconv -f UTF-16 -t UTF-8)\n")


@pytest.mark.parametrize(("config", "why"), [
    ({"callbacks": {"lr_monitor": {}}}, ": the run had no `fp8_stats` callback (add `callbacks: "
                                        "{fp8_stats: {}}` to the YAML)"),
    ({"callbacks": {"fp8_stats": {"layers": "nothing"}}},
     ": fp8_stats ran but logged no layer (callbacks.fp8_stats.layers: 'nothing' matched nothing, "
     "or the run ended before its first logging step)"),
    (None, " (`fp8_<stat>/<tensor>/<layer>` series): was `fp8_stats` in the YAML?"),
], ids=["no-fp8-stats", "no-layer", "no-config"])
def test_a_wandb_run_read_whole_without_fp8_series_says_why(tmp_path, capsys, config, why):
    """Before: `<run>/metrics.jsonl: not found (was the `jsonl` logger in the YAML?)`, though
    the report reads W&B runs and had read this one."""
    from tests.wandb_runs import write_wandb_run

    path = write_wandb_run(tmp_path / "wandb" / "offline-run-20261130_000000-e2" / "run-e2.wandb",
                           range(5), lambda step: {"loss/train/total": 3.0}, config=config)
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {path}: 5 history row(s) read with W&B's reader, no FP8 statistics{why}\n")
