"""FP8058 before the run says what fp8_stats says at FIT_START: under delayed scaling a schedule
whose only step in the run is 0 judges no layer (step 0 casts at the initial scale 1). The
reference is the run itself: the same tiny LLM-Foundry config, linted, then trained."""

from __future__ import annotations

import logging

import pytest
from llmfoundry.command_utils import train
from omegaconf import OmegaConf as om

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from tests.test_s29_dumps_step0_only import _run, _Said
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


@pytest.mark.parametrize("what_if", ["delayed", "current"])
def test_fp8058_reads_the_what_if_recipe_of_a_run_without_fp8_layers(tmp_path, tiny_data,
                                                                     monkeypatch, what_if):
    """Without te_swap or amp_fp8, step 0 is cast under fp8_stats' own what-if `recipe`: the
    run warns at FIT_START under `recipe: delayed`, and the linter said nothing there."""
    monkeypatch.chdir(tmp_path)
    cfg = tiny_config(tmp_path, tiny_data, {
        "max_duration": "3ba", "eval_interval": "3ba", "save_folder": None, "precision": "fp32",
        "callbacks": {"fp8_stats": {"interval": "100ba", "recipe": what_if}}})
    del cfg.algorithms["te_swap"]
    del cfg.callbacks["fp8_state"]  # it reads te_swap's FP8 layers
    path = tmp_path / "train.yaml"
    path.write_text(om.to_yaml(cfg))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    hits = [f for f in entry["findings"] if f["rule"] == "FP8058"]
    said, stats = _Said(), logging.getLogger("foundry_fp8.composer.stats")
    stats.addHandler(said)
    try:
        train(cfg).close()
    finally:
        stats.removeHandler(said)
    assert len(said.lines) == (what_if == "delayed")
    assert [h["key"] for h in hits] == (["callbacks.fp8_stats.interval"] if said.lines else [])
    assert all("only step 0, which delayed scaling casts with its initial scale 1" in h["message"]
               for h in hits)
