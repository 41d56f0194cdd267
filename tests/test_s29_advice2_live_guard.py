"""fp8_guard's own advice where FP8 fails for the whole run (s29 advice2, the lr=1000 docs try):
its fit-end print gave `Next time:` an exclude of all 8 FP8 layers (a config fp8_lint's FP8034
refuses: te_swap converts none), and its budget warning told the user to raise
max_fallback_share when the refused and held layers were every FP8 layer. Now both say the
report's whole-run line, from the one rule (`guard.whole_run`, `WHOLE_RUN_SHARE`), and the
console, fp8_report.md and the live print say the same."""

from __future__ import annotations

import re

import pytest
from torch import nn

from foundry_fp8.cli import main
from foundry_fp8.guard import OPTION, WHOLE_RUN_SHARE, GuardConfig, GuardCore, whole_run
from tests.tiny_run import run_folder, run_tiny

RAISE = f"raise {OPTION}.max_fallback_share"
HEAD = "FP8 is not working for this run as a whole"


@pytest.mark.parametrize(("flagged", "whole"), [(["a"], False), (["a", "b", "c"], True)])
def test_the_budget_warning_gives_no_larger_budget_where_most_layers_are_out(flagged, whole):
    """4 FP8 layers of equal FLOPs, the default budget (10 %) refusing each: 1 refused of 4 is a
    layer's trouble (raise the budget or exclude it); 3 of 4 (WHOLE_RUN_SHARE) the run's."""
    assert WHOLE_RUN_SHARE == 0.75
    core = GuardCore(GuardConfig(), dict.fromkeys("abcd", 0.25))
    table = {(layer, "activation"): {"underflow_pct": 50.0} for layer in "abcd"}
    verdict = core.decide(4, flagged, table)
    assert verdict.refused == flagged and verdict.budget_message is not None
    assert (RAISE in verdict.budget_message) == (not whole), verdict.budget_message
    assert (f"{HEAD}: 3 of its 4 FP8 layers" in verdict.budget_message) == whole


def test_the_rule_counts_the_fp8_layers_out():
    """3/4 or more of the FP8 layers, by name; layers outside FP8 do not count; `count`: FP8
    layers the caller does not name (an fp8_stats watching some)."""
    fp8 = [f"l{i}" for i in range(8)]
    assert whole_run(fp8[:5], fp8, "x") is None
    said = whole_run(fp8[:6], fp8, "x")
    assert said is not None and "6 of its 8 FP8 layers x" in said and "only 2 layers in FP8" in said
    assert whole_run([*fp8[:5], "lm_head"], fp8, "x") is None
    assert "no layer in FP8" in (whole_run(fp8, fp8, "x") or "")
    assert whole_run(fp8[:4], fp8[:4], "x", count=12) is None
    assert whole_run(["a"], [], "x") is None


@pytest.mark.slow
def test_a_guard_holding_every_fp8_layer_gives_no_exclude_of_them_all(tmp_path, tiny_data,
                                                                      capsys):
    """lr=1000 (the docs try), a budget of 100 %: fp8_guard holds all 8 FP8 layers. Its fit-end
    print said `Next time:` with their exclude; now the whole-run line, word for word the one
    of fp8_report.md's fp8_guard section and of `foundry-fp8 report`'s console."""
    trainer = run_tiny(tmp_path, tiny_data, {
        "optimizer": {"lr": 1000.0}, "max_duration": "10ba", "eval_interval": "10ba",
        "save_interval": "10ba", "algorithms": {"gradient_clipping": {"clipping_threshold": 1e30}},
        "callbacks": {"fp8_stats": {"interval": "2ba", "image_interval": None},
                      "fp8_guard": {"max_fallback_share": 1.0}}})
    fp8 = {name for name, module in trainer.state.model.named_modules()
           if isinstance(module, nn.Linear) and ".blocks." in name}
    del trainer
    assert len(fp8) == 8  # te_swap's (lm_head is tied)
    live = capsys.readouterr().out
    table = live[live.index("foundry_fp8 fp8_guard: layers moved to high precision"):]
    assert len(re.findall(r"^\| blocks\.\d\.", table, re.M)) == 8, table  # every one held
    assert "Next time:" not in table and "te_swap: {exclude:" not in table, table
    [said] = [line for line in table.splitlines() if line.startswith(HEAD)]
    assert said.startswith(f"{HEAD}: 8 of its 8 FP8 layers are held in high precision at the "
                           "end, and an exclude of them would leave no layer in FP8"), said
    assert main(["report", str(run_folder(tmp_path))]) == 0
    console = capsys.readouterr().out
    md = (run_folder(tmp_path) / "fp8_report.md").read_text()
    assert said in console and said in md.splitlines(), (console, md)
