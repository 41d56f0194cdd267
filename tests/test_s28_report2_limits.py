"""The run's own limits in `foundry-fp8 report` (QA s28), on a real tiny MPT run: one limit out
of range in hparams.json (hand-edited, another version's) dropped all of the run's limits for
the defaults without a word; a flagged value printed as its own limit ("cos_sim 0.9986 (<
0.9986)") read as a wrong flag."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from foundry_fp8.cli import main
from tests.tiny_run import run_folder, run_tiny


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_data) -> Path:
    """The tiny MPT with fp8_stats at every batch: its metrics.jsonl and hparams.json."""
    tmp = tmp_path_factory.mktemp("run")
    run_tiny(tmp, tiny_data, {"max_duration": "12ba", "eval_interval": "12ba",
                              "callbacks": {"fp8_stats": {"interval": "1ba"}}})
    return run_folder(tmp)


def copy_with(run: Path, to: Path, **limits: float) -> Path:
    """The run's files in `to`, its hparams.json's fp8_stats given `limits` (as a user edits it)."""
    to.mkdir()
    shutil.copy(run / "metrics.jsonl", to)
    hparams = json.loads((run / "hparams.json").read_text())
    hparams["callbacks"]["fp8_stats"].update(limits)
    (to / "hparams.json").write_text(json.dumps(hparams, indent=2))
    return to


def cos_sims(run: Path) -> dict[tuple[str, str], dict[int, float]]:
    """(layer, tensor) -> step -> cos_sim, as logged in the run's JSONL."""
    found: dict[tuple[str, str], dict[int, float]] = {}
    for record in map(json.loads, (run / "metrics.jsonl").open()):
        for key, value in record["metrics"].items():
            if key.startswith("fp8_cos_sim/"):
                _, tensor, layer = key.split("/", 2)
                found.setdefault((layer, tensor), {})[record["step"]] = value
    return found


def test_one_limit_out_of_range_is_refused_alone_and_said(tiny_run, tmp_path, capsys):
    """max_overflow_pct 150 (a percentage over 100) next to min_cos_sim 0.999: the report kept
    neither (fp8_stats defaults, 0 flagged, nothing on stderr). Now 150 is refused in one line
    naming file and key and the default used, and 0.999 flags every row the JSONL has below it
    (the gradients' cos_sim, about 0.9986; weights and activations about 0.9996)."""
    folder = copy_with(tiny_run, tmp_path / "edited", min_cos_sim=0.999, max_overflow_pct=150)
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr()
    assert out.err == (f"warning: {folder / 'hparams.json'}: callbacks.fp8_stats.max_overflow_pct "
                       "150 is out of range (0 to 100); the report uses fp8_stats' default 0.01 "
                       "instead\n")
    below = {row for row, by_step in cos_sims(folder).items()
             if any(v < 0.999 for step, v in by_step.items() if step > 0)}
    assert below and {tensor for _, tensor in below} == {"gradient"}
    assert f"\n{len(below)} flagged\n" in out.out
    md = (folder / "fp8_report.md").read_text()
    assert ("Thresholds from the run's fp8_stats settings (hparams.json; its max_overflow_pct "
            "refused: the default): underflow > 5 %, cos_sim < 0.999, any NaN/Inf, at once; "
            "overflow > 0.01 % with") in md


def test_a_flagged_value_never_prints_as_its_limit(tiny_run, tmp_path, capsys):
    """min_cos_sim set to a gradient's worst cos_sim rounded up at 4 digits (0.99858 -> 0.9986,
    as a user copies a number off the table): the report printed "cos_sim 0.9986 (< 0.9986)".
    Each flag's value now prints with the fewest digits (4 or more) that put it below the limit,
    the JSONL's value at the flag's step rounded so, in the terminal and fp8_report.md."""
    logged = cos_sims(tiny_run)
    worst = [min(v for step, v in by_step.items() if step > 0)
             for (_, tensor), by_step in logged.items() if tensor == "gradient"]
    limit = min(float(f"{v:.4g}") for v in worst if float(f"{v:.4g}") > v)
    folder = copy_with(tiny_run, tmp_path / "edited", min_cos_sim=limit)
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    md = (folder / "fp8_report.md").read_text()
    said = re.findall(r"[`'](\S+)[`'] gradient: cos_sim (\S+) at step (\d+) \(< (\S+);", out)
    said += re.findall(r"\| (\S+) \| gradient \| cos_sim \| (\S+) \(step (\d+)\) \|()", md)
    assert len(said) == 2 * int(re.findall(r"\n(\d+) flagged\n", out)[0]) > 0
    rounded_up = 0
    for layer, shown, step, printed_limit in said:
        assert printed_limit in ("", f"{limit:g}")
        value = logged[layer, "gradient"][int(step)]
        digits = next(n for n in range(4, 18) if float(f"{value:.{n}g}") < limit)
        assert shown == f"{value:.{digits}g}" and float(shown) < limit
        rounded_up += f"{value:.4g}" == f"{limit:g}"
    assert rounded_up  # values 4 digits print as the limit: they read as wrong flags before
