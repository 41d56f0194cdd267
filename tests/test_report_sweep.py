"""`foundry-fp8 report` in a post-mortem: a run still being written (its metrics.jsonl growing
while read, its `.wandb` file with no exit record yet), several runs of a sweep against one
baseline, and `--baseline` reading the run's file once. The expected numbers are worked out
here from the losses written, never from the report's own output."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from foundry_fp8 import jsonl
from foundry_fp8.cli import main
from foundry_fp8.health.keys import LOSS
from foundry_fp8.jsonl import JsonlSink
from foundry_fp8.report import read
from tests.wandb_runs import write_wandb_run

LAYER_KEY = "fp8_underflow_pct/weight/blocks.0.fc"


def _curve(steps: int, scale: float = 1.0, seed: int = 5) -> dict[int, float]:
    rng = random.Random(seed)
    return {s: scale * (2.0 + 8.0 * math.exp(-s / 30) + rng.uniform(-0.05, 0.05))
            for s in range(steps)}


def _run(folder: Path, losses: dict[int, float], fp8: bool = True) -> Path:
    """A run folder whose metrics.jsonl holds the loss at each step and, with `fp8`, one
    per-layer underflow series (as fp8_stats logs it) at each step."""
    sink = JsonlSink(folder / "metrics.jsonl")
    for step, loss in sorted(losses.items()):
        sink.write(step, {LOSS: loss, **({LAYER_KEY: 0.1 * step} if fp8 else {})})
    return folder


def _gap(run: dict[int, float], base: dict[int, float]) -> float:
    """The mean relative gap over the last tenth (rounded up) of the steps both logged."""
    steps = sorted(run.keys() & base.keys())
    window = steps[-math.ceil(len(steps) / 10):]
    return sum((run[s] - base[s]) / base[s] for s in window) / len(window)


def test_the_runs_file_is_read_once_with_a_baseline(tmp_path, monkeypatch, capsys):
    """QA s19 (LOW): `--baseline` read the run's metrics.jsonl a second time just for its loss
    (seconds on a large file; on a file still growing, the loss compared and the heatmaps
    covered different steps)."""
    run = _run(tmp_path / "fp8", _curve(40, 1.03))
    base = _run(tmp_path / "bf16", _curve(40), fp8=False)
    reads: dict[str, int] = {}
    lines = jsonl._lines

    def counted(f: Any) -> Iterator[bytes | None]:
        reads[f.name] = reads.get(f.name, 0) + 1
        return lines(f)

    monkeypatch.setattr(jsonl, "_lines", counted)
    assert main(["report", str(run), "--baseline", str(base)]) == 0
    out = capsys.readouterr().out
    assert reads == {str(run / "metrics.jsonl"): 1, str(base / "metrics.jsonl"): 1}
    assert f"Gap {100 * _gap(_curve(40, 1.03), _curve(40)):+.3g} %" in out, out


def test_a_metrics_file_growing_while_read_is_one_warning_with_what_was_read(tmp_path,
                                                                              monkeypatch, capsys):
    """A report made while the run is live: the file grows during the read. Before, nothing
    said the report covered part of a run still being written."""
    run = _run(tmp_path / "live", _curve(10))
    metrics_file = run / "metrics.jsonl"
    appended = (json.dumps({"step": 10, "metrics": {LOSS: 2.5, LAYER_KEY: 1.0}}) + "\n"
                + '{"step": 11, "metr').encode()  # the writer is mid-line
    records = read.read_jsonl

    def writer_appends(path: Any, *args: Any) -> Iterator[tuple[int, dict[str, Any]]]:
        for n, record in enumerate(records(path, *args)):
            if n == 4:
                with open(path, "ab") as f:
                    f.write(appended)
            yield record

    monkeypatch.setattr(read, "read_jsonl", writer_appends)
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert err == (f"warning: {metrics_file}: grew by {len(appended):,} bytes while the report "
                   "read it: the run is still writing it; the report covers what was read (line "
                   "12, not finished when read, skipped), up to step 10\n"), err


def _wandb_file(path: Path, steps: range, finished: bool) -> Path:
    """An offline run file as W&B's writer leaves it: fp8_stats in its config, one layer's
    series and the loss at each step, the exit record where `finished`."""
    return write_wandb_run(path, steps, lambda step: {LAYER_KEY: 0.1 * step,
                                                      "loss/train/total": 3.0},
                           config={"callbacks": {"fp8_stats": {}}}, finished=finished)


def test_a_wandb_run_still_being_written_says_so_and_reports_what_was_read(tmp_path, capsys):
    """Before: a live run's `.wandb` file was reported as if whole, and one with no FP8 row yet
    read `wandb/metrics.jsonl: not found (was the jsonl logger in the YAML?)`."""
    wandb_dir = tmp_path / "wandb"
    live = _wandb_file(wandb_dir / "offline-run-20261129_010000-abc" / "run-abc.wandb",
                       range(7), finished=False)
    assert main(["report", str(wandb_dir), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert err == (f"warning: {live}: no exit record yet: the run is still being written (or was "
                   "killed, or its disk filled); 7 history row(s) read, up to step 6; the report covers what was "
                   "read, up to step 6\n"), err
    report = (tmp_path / "out" / "fp8_report.md").read_text()
    assert f"{0.1 * 6:.4g}" in report  # the worst underflow, at the last step read

    done = _wandb_file(tmp_path / "done" / "offline-run-20261129_010000-d" / "run-d.wandb",
                       range(7), finished=True)
    assert main(["report", str(done), "--out", str(tmp_path / "out2")]) == 0
    assert capsys.readouterr().err == ""

    empty = tmp_path / "early" / "wandb"
    started = _wandb_file(empty / "offline-run-20261129_010000-e" / "run-e.wandb", range(0),
                          finished=False)
    assert main(["report", str(empty)]) == 2
    assert capsys.readouterr().err == (
        f"error: {started}: no exit record yet: the run is still being written (or was killed, "
        "or its disk filled); no history row read, no FP8 statistics among them yet (fp8_stats logs from its first "
        "`interval`)\n")


def test_a_sweep_is_reported_run_by_run_against_one_baseline(tmp_path, capsys):
    """`report A B --baseline BF16` was `unrecognized arguments: B`: each run is reported as
    alone, into its own folder, then one line per run."""
    base = _curve(50)
    runs = {"margin0": _curve(50, 1.02), "margin1": _curve(50, 0.99, seed=7)}
    folders = [_run(tmp_path / name, losses) for name, losses in runs.items()]
    bf16 = _run(tmp_path / "bf16", base, fp8=False)
    assert main(["report", *map(str, folders), "--baseline", str(bf16)]) == 0
    out = capsys.readouterr().out
    assert all((folder / "fp8_report.md").is_file() for folder in folders)
    summary = out[out.index("2 runs:\n"):]
    assert summary == "2 runs:\n" + "".join(
        f"  {folder}: 0 flagged, loss gap {100 * _gap(losses, base):+.3g} % (last 5 compared "
        "steps)\n" for folder, losses in zip(folders, runs.values(), strict=True)), summary


@pytest.mark.parametrize("extra, said", [
    (["--baseline", "a", "--baseline", "b"],
     "error: --baseline given 2 times (a, b): one baseline per report (the runs to report are "
     "the positional RUN_FOLDERs)\n"),
    (["b", "--out", "o"],
     "error: --out with 2 runs: their reports would overwrite each other there; leave --out out "
     "(each report goes into its run's folder) or report one run per --out\n")])
def test_a_second_baseline_or_one_out_for_several_runs_is_one_line(tmp_path, capsys, extra, said):
    """A repeated `--baseline` was silently the last one (argparse keeps the last)."""
    assert main(["report", "a", *extra]) == 2
    assert capsys.readouterr().err == said


def _metrics_file(path: Path, losses: dict[int, float]) -> Path:
    """A metrics file of the run's own name (`sweep/a.jsonl`), as `_run` writes it."""
    sink = JsonlSink(path)
    for step, loss in sorted(losses.items()):
        sink.write(step, {LOSS: loss, LAYER_KEY: 0.1 * step})
    return path


def test_runs_whose_reports_share_a_folder_are_one_line_before_any_is_written(tmp_path,
                                                                             monkeypatch, capsys):
    """QA s19 (MED): `report sweep/a.jsonl sweep/b.jsonl` exited 0 and printed `written to
    sweep/fp8_report.md` twice: a's report and heatmaps replaced by b's, the summary listing
    both. The same run given twice (`one one/metrics.jsonl`) wrote its report twice."""
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    a = _metrics_file(sweep / "a.jsonl", _curve(20))
    b = _metrics_file(sweep / "b.jsonl", _curve(20, 1.1))
    assert main(["report", str(a), str(b)]) == 2
    assert capsys.readouterr().err == (
        f"error: {a} and {b}: both reports would go into {sweep} (the second replacing the "
        "first); report them one at a time with --out DIR\n")
    assert sorted(p.name for p in sweep.iterdir()) == ["a.jsonl", "b.jsonl"]  # nothing written

    one = _run(tmp_path / "one", _curve(20))
    for given in (["one", "one/metrics.jsonl"], [str(one), "./one/"]):
        assert main(["report", *given]) == 2
        assert capsys.readouterr().err == (  # named as given, as argparse's Path makes them
            f"error: {Path(given[0])} and {Path(given[1])}: the same run given twice; name it "
            "once\n")
    assert sorted(p.name for p in one.iterdir()) == ["metrics.jsonl"]

    # a run that names nothing is its own error in its turn; the others are reported
    assert main(["report", "one", "missing"]) == 2
    assert (one / "fp8_report.md").is_file()
