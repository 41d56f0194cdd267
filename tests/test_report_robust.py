"""`foundry-fp8 report` on hostile input QA found: integers no float holds, JSON nested beyond
the parser's recursion, fp8_guard records of the wrong shape, and values at float64's edges in
the plots. A bad value or record is left out (a bad line or record with one warning line), the
rest is reported, exit 0; never a traceback, never a Python warning on stderr."""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import pytest

from foundry_fp8.cli import main
from foundry_fp8.guard import FALLBACK_LAYERS, FALLBACK_PREFIX, REPROMOTION_PREFIX, Fallback
from foundry_fp8.health import layer_key
from foundry_fp8.jsonl import JsonlSink
from tests.test_report import (
    HEALTHY,
    L0,
    L1,
    L2,
    STEPS,
    assert_valid_png,
    in_step_order,
    write_run,
)

BIG = "1" + "0" * 400  # a JSON integer too large for a float
DEEP = "[" * 100_000 + "]" * 100_000  # nested far beyond json's recursion limit
UNDERFLOW_L1 = layer_key("underflow_pct", "gradient", L1)


def report(folder: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, str, str]:
    """stdout, stderr and fp8_report.md of a report that must succeed."""
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr()
    return out.out, out.err, (folder / "fp8_report.md").read_text()


@pytest.mark.parametrize(("line", "skipped"), [
    (f'{{"step": 30, "metrics": {{"{UNDERFLOW_L1}": {BIG}}}}}', False),
    (DEEP, True),
    ('{"step": 30, "metrics": {"x": ' + DEEP + "}}", True),
], ids=["huge-integer-value", "deep-line", "deep-value"])
def test_an_unusable_value_or_line_is_left_out_and_the_rest_reported(tmp_path, capsys, line,
                                                                     skipped):
    """A value no float holds is left out as a wrong-typed one is (silently: another logger's
    value may be anything); a line nested too deep to decode is skipped like a cut line."""
    path = write_run(tmp_path) / "metrics.jsonl"
    with path.open("a") as f:
        f.write(line + "\n")
    JsonlSink(path).write(40, {UNDERFLOW_L1: 0.0})  # a good record after the bad line
    stdout, stderr, md = report(tmp_path, capsys)
    # nesting no writer makes, named as such (before: "a run killed mid-write leaves one")
    assert stderr == (f"warning: {path}:4: skipped 1 line that does not decode (line 4: nested "
                      "deeper than Python's json decodes (no logger writes one)); the report "
                      "covers the rest\n" if skipped else "")
    # step 30 gave no number; step 40's 0 % counts: L1's underflow logged at 4 steps
    assert f"'{L1}' gradient: underflow_pct 9 % at step 20 (> 5 %; 1 of 4 steps)" in stdout
    assert "4 logging steps (0 to 40)" in md


def test_a_line_of_nuls_past_the_cap_is_skipped_with_one_warning_saying_so(tmp_path, capsys,
                                                                        monkeypatch):
    """A power loss can leave a long run of NULs with no newline: skipped unread (its size is
    the reader's cap on a line, MAX_LINE_BYTES), named in the one warning, the rest reported."""
    import foundry_fp8.jsonl as jsonl

    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", 4096)
    path = write_run(tmp_path) / "metrics.jsonl"
    with path.open("ab") as f:
        f.write(b"\0" * 10_000)
    JsonlSink(path).write(40, {UNDERFLOW_L1: 0.0})  # the resumed run's, on a fresh line
    stdout, stderr, md = report(tmp_path, capsys)
    assert stderr == (f"warning: {path}:4: skipped 1 line that does not decode (line 4; a run "
                      "killed mid-write leaves one; line 4 is longer than 4,096 bytes, left "
                      "unread: a power loss can leave a run of NUL bytes); the report covers the "
                      "rest\n")
    assert "4 logging steps (0 to 40)" in md


@pytest.mark.parametrize("underflow", [BIG, '"x"', "NaN"], ids=["huge-integer", "string", "nan"])
def test_a_threshold_no_float_holds_is_ignored_like_a_string_or_nan(tmp_path, capsys,
                                                                      underflow):
    """The default underflow threshold (5 %) stands in, said in one line naming the file and the
    key (before, silently, and the thresholds line called 5 % the run's); the run's other
    thresholds still hold."""
    write_run(tmp_path)
    (tmp_path / "hparams.json").write_text(
        '{"callbacks": {"fp8_stats": {"max_underflow_pct": ' + underflow + ', "min_cos_sim": 0.95}}}')
    stdout, stderr, md = report(tmp_path, capsys)
    why = {BIG: "is an integer too large for a float", '"x"': "is a string, not a limit",
           "NaN": "is nan, not a limit"}[underflow]
    assert stderr == (f"warning: {tmp_path / 'hparams.json'}: callbacks.fp8_stats.max_underflow_pct "
                      f"{why}; the report uses fp8_stats' default 5 instead\n")
    assert ("Thresholds from the run's fp8_stats settings (hparams.json; its max_underflow_pct "
            "refused: the default): underflow > 5 %, cos_sim < 0.95,") in md
    assert "1 flagged" in stdout  # L2's cos_sim 0.98 is within 0.95


#: A run's hparams.json with an underflow limit of 0.4 % (json.dumps(indent=2), as the `jsonl`
#: logger writes it): L1's and L2's gradient underflow (up to 9 % and 0.5 %) and L2's cos_sim
#: (0.98) are flagged, 3 findings; under the defaults (5 %) L2's 0.5 % is not, 2 findings.
OWN_LIMITS = ('{\n  "callbacks": {\n    "fp8_stats": {\n      "max_underflow_pct": 0.4\n'
              '    }\n  },\n  "run_name": "thr-copy"\n}\n')
WITHOUT = ("; the report goes on without it: fp8_stats' default thresholds, no fp8_guard fallback "
           "record\n")


def test_the_run_s_own_thresholds_flag_more_than_the_defaults(tmp_path, capsys):
    """What a cut hparams.json loses: 3 findings under the run's 0.4 %, not 2."""
    write_run(tmp_path)
    (tmp_path / "hparams.json").write_text(OWN_LIMITS)
    stdout, stderr, md = report(tmp_path, capsys)
    assert not stderr and "3 flagged" in stdout
    assert "Thresholds from the run's fp8_stats settings (hparams.json): underflow > 0.4 %" in md


def test_an_earlier_run_set_aside_is_read_with_its_own_hparams(tmp_path, capsys):
    """The `jsonl` logger moves an earlier run's files to `metrics.<n>.jsonl` and
    `hparams.<n>.json`: its report takes that run's 0.4 %, not the new run's defaults."""
    write_run(tmp_path)
    (tmp_path / "metrics.jsonl").rename(tmp_path / "metrics.2.jsonl")
    (tmp_path / "hparams.2.json").write_text(OWN_LIMITS)
    (tmp_path / "hparams.json").write_text('{"callbacks": {"fp8_stats": {}}}')
    assert main(["report", str(tmp_path / "metrics.2.jsonl")]) == 0
    stdout = capsys.readouterr().out
    assert "3 flagged" in stdout
    (tmp_path / "hparams.2.json").unlink()  # none kept: the one beside it, the defaults here
    assert main(["report", str(tmp_path / "metrics.2.jsonl")]) == 0
    assert "2 flagged" in capsys.readouterr().out


def _denied(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unreadable file, also for root (whom chmod 000 does not stop)."""
    path.write_text(OWN_LIMITS)
    real = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        if self == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)


@pytest.mark.parametrize(("make", "why"), [
    # cut 9 bytes short (`-copy"\n}\n`): line 7's string opens at column 15 (after `  "run_name": `)
    (lambda p, _: p.write_text(OWN_LIMITS[:-9]),
     ":7:15: not JSON (Unterminated string starting at; the file stops mid-document, cut short)"),
    (lambda p, _: p.write_text(OWN_LIMITS.replace(",\n", ",,\n")),
     ":6:5: not JSON (Expecting property name enclosed in double quotes)"),
    (lambda p, _: p.write_text(""), ": empty (a run killed while writing it leaves one)"),
    (lambda p, _: p.write_text("[1, 2]"), ": an array, not a JSON object of hyperparameters"),
    (lambda p, _: p.write_text("null"), ": null, not a JSON object of hyperparameters"),
    (lambda p, _: p.write_bytes(b'{"run_name": "\xe9"}'),  # Latin-1: the 15th byte
     ": not JSON (not UTF-8 text at byte offset 14)"),
    (lambda p, _: p.write_text(DEEP),
     ": not JSON the report reads (nested deeper than Python's JSON parser goes)"),
    (lambda p, _: p.write_text('{"a": 1' + "0" * 5000 + "}"),
     ": not JSON the report reads (Exceeds the limit (4300 digits) for integer string "
     "conversion)"),
    (lambda p, _: p.mkdir(), ": a folder, not the run's hparams.json"),
    (lambda p, _: os.mkfifo(p), ": not a regular file"),  # a read would block forever
    (lambda p, _: (p.touch(), os.truncate(p, 100 * 2**20)),  # sparse: no disk, 0 bytes read
     ": 100 MiB, more than a run's hparams.json holds (the report reads up to 64 MiB)"),
    (_denied, ": cannot read (Permission denied)"),
], ids=["cut", "bad-comma", "empty", "array", "null", "not-utf8", "deep", "huge-integer",
        "folder", "fifo", "huge-file", "unreadable"])
def test_an_hparams_json_that_does_not_read_is_one_warning_saying_what_the_report_drops(
        tmp_path, capsys, monkeypatch, make, why):
    """QA: a copy of a run with a cut hparams.json said "0 flagged, Thresholds from fp8_stats
    defaults" and nothing else. One warning names the file (and line:column where JSON says)
    and what the report goes on without; the report is the defaults' (2 findings, not 3)."""
    write_run(tmp_path)
    hparams = tmp_path / "hparams.json"
    make(hparams, monkeypatch)
    stdout, stderr, md = report(tmp_path, capsys)
    assert stderr == f"warning: {hparams}{why}{WITHOUT}"
    assert "2 flagged" in stdout
    assert "Thresholds from fp8_stats defaults: underflow > 5 %, cos_sim < 0.99," in md


def test_no_hparams_json_is_no_warning(tmp_path, capsys):
    """A run without the `jsonl` logger's hyperparameters: nothing is wrong with it."""
    write_run(tmp_path)
    stdout, stderr, _ = report(tmp_path, capsys)
    assert not stderr and "2 flagged" in stdout


GOOD = Fallback(L1, 10, 0.25, ("message",), {"gradient/cos_sim": 0.9}).record()
REPROMOTED = {"layer": L1, "step": 20, "fallen_at": 10, "healthy_steps": 3, "numbers": {}}
BAD_RECORDS = {  # hparams.json key: a record of the wrong shape
    f"{FALLBACK_PREFIX}numbers-list": {**GOOD, "numbers": [1, 2]},
    f"{FALLBACK_PREFIX}numbers-huge": {**GOOD, "numbers": {"a": BIG}},
    f"{FALLBACK_PREFIX}share-text": {**GOOD, "flops_share": "abc"},
    f"{FALLBACK_PREFIX}share-huge": {**GOOD, "flops_share": BIG},
    f"{FALLBACK_PREFIX}reasons-numbers": {**GOOD, "reasons": [1]},
    f"{FALLBACK_PREFIX}step-bool": {**GOOD, "step": True},
    f"{FALLBACK_PREFIX}step-huge": {**GOOD, "step": 10**4300 - 1},  # step + 1 has no str()
    f"{FALLBACK_PREFIX}step-negative": {**GOOD, "step": -3},
    f"{FALLBACK_PREFIX}list": [GOOD],
    f"{REPROMOTION_PREFIX}numbers-text": {**REPROMOTED, "numbers": "abc"},
    f"{REPROMOTION_PREFIX}steps-float": {**REPROMOTED, "healthy_steps": 2.5},
}


def test_fp8_guard_records_of_the_wrong_shape_are_left_out_with_one_warning_each(tmp_path,
                                                                                 capsys):
    """The good fallback among them still makes the guard section."""
    write_run(tmp_path)
    hparams = tmp_path / "hparams.json"
    text = json.dumps({"callbacks": {"fp8_stats": {}, "fp8_guard": {}},
                       FALLBACK_PREFIX + L1: GOOD, **BAD_RECORDS})
    hparams.write_text(text.replace(f'"{BIG}"', BIG))  # a bare integer
    stdout, stderr, md = report(tmp_path, capsys)
    assert stderr == "".join(
        f"warning: {hparams}: key '{key}': not an fp8_guard "
        f"{'fallback' if key.startswith(FALLBACK_PREFIX) else 're-promotion'} record; left out\n"
        for key in BAD_RECORDS)
    assert f"fp8_guard moved 1 layer(s) to high precision: {L1} from step 11." in stdout
    assert f"| {L1} | 11 | the end | 25.0 % | message |" in md


def test_a_non_finite_fp8_guard_series_value_is_left_out(tmp_path, capsys):
    """A NaN layer count is no count: the last finite one (1) agrees with hparams.json."""
    path = write_run(tmp_path) / "metrics.jsonl"
    for step, layers in ((10, 1.0), (20, float("nan"))):
        JsonlSink(path).write(step, {FALLBACK_LAYERS: layers})
    in_step_order(path)
    (tmp_path / "hparams.json").write_text(json.dumps({FALLBACK_PREFIX + L1: GOOD}))
    stdout, stderr, md = report(tmp_path, capsys)
    assert not stderr and "fp8_guard moved 1 layer(s)" in stdout
    assert "fp8_guard moved 1 layer(s) to high precision during the run" in md
    assert "part of the run's record is missing" not in md


EVERY_CELL = [(layer, step) for layer in (L0, L1, L2) for step in STEPS]


@pytest.mark.parametrize("cells", [
    {(L1, 20): float("inf"), (L2, 10): 5e-324, (L0, 10): -1e308, (L0, 0): float("nan")},
    dict.fromkeys(EVERY_CELL, 1e308), dict.fromkeys(EVERY_CELL, 5e-324),
    dict.fromkeys(EVERY_CELL, 0.0),
], ids=["one-cell-each", "every-cell-1e308", "every-cell-5e-324", "every-cell-0"])
def test_values_at_float64_edges_draw_without_python_warnings(tmp_path, capsys, cells):
    """Every statistic of a (layer, step) set to a value at float64's edges: no overflow in the
    plots' arithmetic, no log axis without a positive value, no number too wide for its cell;
    every PNG drawn."""
    path = write_run(tmp_path) / "metrics.jsonl"
    for (layer, step), value in cells.items():  # a step logged again keeps the later values
        JsonlSink(path).write(step, {layer_key(stat, tensor, layer): value for stat in HEALTHY
                                     for tensor in ("activation", "gradient")})
    in_step_order(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stdout, stderr, _ = report(tmp_path, capsys)
    assert [f"{w.filename}:{w.lineno}: {w.message}" for w in caught] == []
    assert not stderr
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == sorted(line.strip() for line in stdout.splitlines() if line.endswith(".png"))
    assert "fp8_timeseries.png" in pngs
    for png in pngs:
        assert_valid_png(tmp_path / png, min_pixels=10_000)


@pytest.mark.parametrize("name", ["fp8_report.md", "fp8_timeseries.png"])
def test_a_fifo_where_an_output_goes_is_one_line_not_a_hang(tmp_path, name):
    """Opening a FIFO to write waits for a reader forever: every output (the markdown, the
    PNGs) is written through one helper that refuses what is not a regular file, and replaces a
    regular one in one step. A subprocess with a timeout, so a hang fails instead of hanging."""
    import subprocess
    import sys

    write_run(tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / name)
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "report",
                           str(tmp_path / "run"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"error: {out / name}: cannot write (a FIFO (named pipe), not a "
                           "regular file: remove it, or write elsewhere)\n")


def test_outputs_replace_a_regular_file_whole(tmp_path, capsys):
    """A report written again replaces the old files in one step: no temporary file left."""
    write_run(tmp_path)
    (tmp_path / "fp8_report.md").write_text("old")
    report(tmp_path, capsys)
    assert (tmp_path / "fp8_report.md").read_text().startswith("#")
    assert not list(tmp_path.glob(".*.tmp"))


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["report", *argv]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("error: ") and out.err.count("\n") == 1 and not out.out
    return out.err.removeprefix("error: ").rstrip("\n")


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy-pickle"])
def test_a_checkpoint_given_as_the_run_is_named_so_without_reading_its_lines(
        tmp_path, capsys, monkeypatch, zipped):
    """QA: `foundry-fp8 report <run>/checkpoints/ep0-ba20-rank0.pt` said `...pt:2786: not a
    metrics record (a JSON int ...)` after scanning the file line by line (gigabytes for a real
    model): its first bytes (torch.save's zip archive, or the legacy pickle) say what it is."""
    import torch

    from foundry_fp8.report import read

    path = tmp_path / "ep0-ba20-rank0.pt"
    torch.save({"state": {"model": torch.arange(5000)}}, path,
               _use_new_zipfile_serialization=zipped)
    monkeypatch.setattr(read, "read_jsonl", lambda *_: pytest.fail("read line by line"))
    kind = "zip archive" if zipped else "pickle"
    assert _one_line_error([str(path)], capsys) == (
        f"{path}: a {kind} (a checkpoint?), not a metrics file: the report reads the `jsonl` "
        "logger's metrics.jsonl in the run folder")


def test_a_json_document_given_as_the_run_is_named_so(tmp_path, capsys):
    """QA: `foundry-fp8 report runs/x/hparams.json` said `hparams.json:87: not a metrics record
    (a JSON float ...)`, the first of its lines that decodes alone."""
    path = tmp_path / "hparams.json"
    path.write_text(json.dumps({"run_name": "x", "callbacks": {"fp8_stats": {"interval": 10}},
                                "lr": 0.003}, indent=2))
    assert _one_line_error([str(path)], capsys) == (
        f"{path}: one JSON document over 9 lines, not the JSON Lines metrics file (a "
        '{"step": ..., "metrics": {...}} record a line) the `jsonl` logger writes as '
        "metrics.jsonl")


def test_a_folder_below_the_run_names_the_run_folder(tmp_path, capsys, monkeypatch):
    """QA: the report pointed at the W&B run folder inside the run (`<run>/wandb/latest-run`,
    where `mpt-tiny-cpu.yaml` puts it) or at `<run>/checkpoints` said only `metrics.jsonl: not
    found (was the jsonl logger in the YAML?)`: it now names the run folder above that holds
    it, as the user typed the path."""
    run = write_run(tmp_path / "runs" / "tiny")
    offline = run / "wandb" / "offline-run-20261129_001959-8ksigzo3"
    (offline / "files").mkdir(parents=True)
    (offline / "run-8ksigzo3.wandb").write_bytes(b":W&B\x00")
    (run / "wandb" / "latest-run").symlink_to(offline.name)
    (run / "checkpoints").mkdir()
    monkeypatch.chdir(tmp_path)
    assert _one_line_error(["runs/tiny/wandb/latest-run"], capsys) == (
        "runs/tiny/wandb/latest-run/metrics.jsonl: not found (a W&B run folder: the report "
        "reads the `jsonl` logger's metrics.jsonl); the run's is in runs/tiny: foundry-fp8 "
        "report runs/tiny")
    assert _one_line_error([str(run / "checkpoints")], capsys) == (
        f"{run / 'checkpoints' / 'metrics.jsonl'}: not found; the run's is in {run}: "
        f"foundry-fp8 report {run}")
    monkeypatch.chdir(offline / "files")  # `report .` where W&B keeps the run's files
    assert _one_line_error(["."], capsys) == (
        "metrics.jsonl: not found; the run's is in ../../..: foundry-fp8 report ../../..")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _one_line_error([str(empty)], capsys) == (
        f"{empty / 'metrics.jsonl'}: not found (was the `jsonl` logger in the YAML?)")


def test_an_mlflow_run_without_per_layer_series_is_one_line(tmp_path, capsys, monkeypatch):
    """An MLflow file store, written by MLflow's own client: its run folder, experiment folder
    or the store (one run in it) are read with MLflow's client (test_report_mlflow); a run
    without fp8_stats' per-layer series, a folder of several runs and a run id the tracking
    server does not hold are each one line."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    store = tmp_path / "mlruns"
    client = MlflowClient(tracking_uri=f"file://{store}")
    experiment = client.create_experiment("fp8")
    assert _one_line_error([str(store)], capsys) == (
        f"{store}: an MLflow store holding no run (the report reads a run's folder, "
        "mlruns/<experiment id>/<run id>, or the `jsonl` logger's metrics.jsonl)")
    run_id = client.create_run(experiment).info.run_id
    client.log_metric(run_id, "fp8/flagged_layers", 1.0, step=0)
    for folder in (store, store / experiment, store / experiment / run_id):
        assert _one_line_error([str(folder)], capsys) == (
            f"{folder}: MLflow run {run_id}: only fp8_stats' summary series, no per-layer series "
            "(fp8_<stat>/<tensor>/<layer>) to say which layer (left out by the logger's "
            "ignore_metrics?)")
    other = client.create_run(experiment).info.run_id
    client.log_metric(other, "loss/train/total", 1.0, step=0)
    assert _one_line_error([str(store / experiment / other)], capsys) == (
        f"{store / experiment / other}: MLflow run {other}: no FP8 statistics: was fp8_stats in "
        "the YAML?")
    said = _one_line_error([str(store / experiment)], capsys)
    assert said.startswith(f"{store / experiment}: 2 MLflow runs (") and said.endswith(
        "): name one run's folder") and run_id in said and other in said
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{store}")
    said = _one_line_error(["mlflow:0123abcd"], capsys)
    assert said.startswith("mlflow:0123abcd: MLflow: Run '0123abcd' not found"), said
