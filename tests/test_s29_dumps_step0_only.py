"""A delayed-scaling run whose schedule logs only step 0 (the default `interval: 100ba` in a
20-batch run) says so at FIT_START: delayed scaling casts a fresh run's step 0 with its initial
scale 1 (no amax recorded yet), so that step judges no layer and the summary ended with every row
"Never judged", with no word before. A current-scaling run's step 0 is judged: no warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from llmfoundry.command_utils import train

from tests.tiny_run import run_folder, tiny_config

SAID = "but step 0, which delayed scaling casts with its initial scale 1"


class _Said(logging.Handler):
    """fp8_stats' own log records (LLM-Foundry's train() sets the root logger's handlers anew,
    pytest's caplog among them)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("fp8_stats: no logging step"):
            self.lines.append(record.getMessage())


def _run(tmp_path, tiny_data, scaling: str, interval: str) -> tuple[str, list[str]]:
    """A 3-batch tiny run, no checkpoint (its run folder: runs/<run_name> in the working
    directory); its metrics.jsonl and fp8_stats' warnings of no logging step."""
    overrides = {"max_duration": "3ba", "eval_interval": "3ba", "save_folder": None,
                 "callbacks": {"fp8_stats": {"interval": interval}}}
    said, stats = _Said(), logging.getLogger("foundry_fp8.composer.stats")
    stats.addHandler(said)
    try:
        cfg = tiny_config(tmp_path, tiny_data, overrides)
        cfg.algorithms.te_swap.fp8_recipe = {"scaling": scaling}  # TE's defaults otherwise
        train(cfg).close()
    finally:
        stats.removeHandler(said)
    return (Path("runs") / run_folder(tmp_path).name / "metrics.jsonl").read_text(), said.lines


def test_a_delayed_run_that_logs_step_0_alone_is_told_at_fit_start(tmp_path, tiny_data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    records, said = _run(tmp_path, tiny_data, "delayed", "100ba")
    # the run logged step 0 only, every row at the initial scale (the monitor's own marker)
    assert '"fp8_initial_scale/' in records
    assert said == [
        "fp8_stats: no logging step in this run but step 0, which delayed scaling casts with its "
        "initial scale 1 (no amax recorded yet), so no layer is judged (it ends after batch 2; "
        "interval 100, start 0, end None): lower callbacks.fp8_stats.interval or start to see "
        "FP8 statistics"]


@pytest.mark.parametrize(("scaling", "interval"), [("current", "100ba"), ("delayed", "2ba")])
def test_a_run_with_a_judged_logging_step_hears_nothing(tmp_path, tiny_data, monkeypatch,
                                                        scaling, interval):
    monkeypatch.chdir(tmp_path)
    records, said = _run(tmp_path, tiny_data, scaling, interval)
    assert '"fp8_' in records and said == []
