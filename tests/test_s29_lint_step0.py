"""FP8058 before the run says what fp8_stats says at FIT_START: under delayed scaling a schedule
whose only step in the run is 0 judges no layer (step 0 casts at the initial scale 1). The
reference is the run itself: the same tiny LLM-Foundry config, linted, then trained."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf as om

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from tests.test_s29_dumps_step0_only import _run
from tests.tiny_run import tiny_config


@pytest.mark.parametrize(("scaling", "interval"), [("delayed", "100ba"), ("current", "100ba"),
                                                   ("delayed", "2ba")])
def test_fp8058_says_step_0_alone_exactly_where_the_run_does(tmp_path, tiny_data, monkeypatch,
                                                             scaling, interval):
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config(tmp_path, tiny_data, {"max_duration": "3ba", "eval_interval": "3ba",
                                            "save_folder": None,
                                            "callbacks": {"fp8_stats": {"interval": interval}}})
    cfg.algorithms.te_swap.fp8_recipe = {"scaling": scaling}
    path = tmp_path / "train.yaml"
    path.write_text(om.to_yaml(cfg))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    hits = [f for f in entry["findings"] if f["rule"] == "FP8058"]
    _, said = _run(tmp_path / "run", tiny_data, scaling, interval)
    assert [h["key"] for h in hits] == (["callbacks.fp8_stats.interval"] if said else [])
    assert all("only step 0, which delayed scaling casts with its initial scale 1" in h["message"]
               for h in hits)
