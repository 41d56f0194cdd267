"""`foundry-fp8 report RUN --baseline BASE` where the runs differ in the update, not the batches
(s29 docs try: a 60-batch run against a 30-batch baseline, both cosine, read "more than 5 %
below the baseline ... check for a label or mask leak", and no warning): each real run below
differs from the baseline in one setting; the report warns where Composer's learning rate at a
compared step differs (read from each run's own `lr_monitor` series), and not where it does not
(a constant schedule over another max_duration)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from foundry_fp8.cli import main
from tests.tiny_run import run_folder, run_plain

pytestmark = pytest.mark.slow

END = 6
#: The tiny YAML's cosine schedule with its length fixed (it no longer reads max_duration) and
#: a warmup short enough that another alpha_f moves a compared loss.
FIXED = {"t_warmup": "2ba", "t_max": "40ba"}
#: name: (its overrides of the tiny YAML, its baseline's name, the warning's words or None)
RUNS: dict[str, tuple[dict[str, Any], str | None, str | None]] = {
    "base": ({}, None, None),
    "longer": ({"max_duration": f"{2 * END}ba"}, "base",
               f"max_duration {2 * END}ba vs {END}ba (the schedule runs over it)"),
    "fixed": ({"scheduler": FIXED}, None, None),
    "fixed-longer": ({"scheduler": FIXED, "max_duration": f"{2 * END}ba"}, "fixed", None),
    "lr": ({"scheduler": FIXED, "optimizer": {"lr": 1.0e-3}}, "fixed",
           "optimizer.lr 0.001 vs 0.003"),
    "alpha": ({"scheduler": {**FIXED, "alpha_f": 0.5}}, "fixed", "scheduler.alpha_f 0.5 vs 0.1"),
}
LR = "lr-DecoupledAdamW/group0"  # Composer's LRMonitor
LOSS = "loss/train/total"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data) -> Path:
    root = tmp_path_factory.mktemp("runs")
    for name, (overrides, _, _) in RUNS.items():
        duration = overrides.get("max_duration", f"{END}ba")
        run_plain(root, tiny_data, {
            "variables": {"run_name": name}, "max_duration": duration,
            "eval_interval": duration, "save_interval": duration,
            "eval_subset_num_batches": 1, "callbacks": {"lr_monitor": {}}, **overrides})
    return root


def _series(folder: Path, key: str) -> dict[int, float]:
    return {record["step"]: record["metrics"][key]
            for line in (folder / "metrics.jsonl").read_text().splitlines()
            if key in (record := json.loads(line))["metrics"]}


@pytest.mark.parametrize("name", [name for name, (_, base, _) in RUNS.items() if base])
def test_a_baseline_that_updates_otherwise_is_said_not_comparable(runs, name, capsys):
    _, base, words = RUNS[name]
    assert base is not None
    run, baseline = run_folder(runs, name), run_folder(runs, base)
    # the reference: the runs' own learning rate at the steps both logged (the loss there
    # follows a step later: equal, to the bit, where the rate is)
    ours, theirs = _series(run, LR), _series(baseline, LR)
    shared = ours.keys() & theirs.keys()
    assert len(shared) == END
    assert any(ours[s] != theirs[s] for s in shared) == (words is not None), (ours, theirs)
    if words is None:
        loss, base_loss = (_series(folder, LOSS) for folder in (run, baseline))
        assert [loss[s] for s in range(END)] == [base_loss[s] for s in range(END)]
    capsys.readouterr()
    assert main(["report", str(run), "--baseline", str(baseline)]) == 0
    out = capsys.readouterr().out
    warned = [line.strip() for line in out.splitlines() if "another optimizer" in line]
    if words is None:
        assert warned == [], warned
        return
    assert warned == [
        f"warning: --baseline {baseline} trained with another optimizer or learning-rate "
        f"schedule: {words} (this run vs the baseline): at a step the runs are at other points "
        "of training, so the loss gap says nothing of FP8 (nor of a label or mask leak); compare "
        "with a baseline that differs in FP8 alone"], warned


def test_other_gradient_clipping_is_said_not_comparable(runs, tmp_path, capsys):
    """The update's clipping: the `fixed` run's own files, its threshold 0.5 in a copy's
    hparams.json (a clipped update is another update: no trajectory to compare)."""
    fixed = run_folder(runs, "fixed")
    copy = tmp_path / "clip"
    copy.mkdir()
    config = json.loads((fixed / "hparams.json").read_text())
    assert config["algorithms"]["gradient_clipping"]["clipping_threshold"] == 1.0
    config["algorithms"]["gradient_clipping"]["clipping_threshold"] = 0.5
    (copy / "hparams.json").write_text(json.dumps(config))
    (copy / "metrics.jsonl").write_text((run_folder(runs, "fixed-longer") / "metrics.jsonl")
                                        .read_text())
    capsys.readouterr()
    assert main(["report", str(copy), "--baseline", str(fixed)]) == 0
    assert ("schedule: algorithms.gradient_clipping.clipping_threshold 0.5 vs 1.0 (this run vs "
            "the baseline)") in capsys.readouterr().out
