"""The stale-scale rule allows for the recipe's `margin`: TE's delayed scale is
(fp8_max / amax) / 2**margin (TE 2.20.2 pytorch/quantization.py:1111), so a run at margin 5
casts at 1/32 of the current scale by design, and its underflow is not an old amax spike that a
shorter `amax_history_len` would cure."""

from __future__ import annotations

import pytest

from foundry_fp8.cli import main
from foundry_fp8.health.rules import DelayedRecipe, HealthTracker
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.report.read import recipes_from_hparams
from tests.tiny_run import run_folder, run_tiny

ROW = ("blocks.0.attn.Wqkv", "gradient")


def _rules(tracker: HealthTracker, ratio: float, whatif: bool = False) -> list[tuple[str, str]]:
    """The rules and changes one underflowing row (20 %) at scale / current_scale `ratio`
    raises."""
    table = {ROW: {"underflow_pct": 20.0, "scale": ratio, "current_scale": 1.0}}
    flags = tracker.update(1, table, {ROW} if whatif else ()).get(ROW, [])
    return [(f.rule, f.yaml_key) for f in flags]


def test_a_scale_the_margin_sets_is_not_stale():
    rules = _rules(HealthTracker(margin=5), 1 / 32)
    assert [rule for rule, _ in rules] == ["underflow"]  # before: underflow_stale
    [flag] = HealthTracker(margin=5).update(1, {ROW: {"underflow_pct": 20.0, "scale": 1 / 32,
                                                      "current_scale": 1.0}})[ROW]
    assert "margin 5" in flag.cause


def test_a_scale_stale_beyond_the_margin_is_and_names_the_history_length():
    [(rule, key)] = _rules(HealthTracker(margin=5, history_len=1024), 1 / 32 / 17)
    assert rule == "underflow_stale"
    assert key.endswith("amax_history_len (shorter than 1024)")
    [flag] = HealthTracker(margin=5).update(1, {ROW: {"underflow_pct": 20.0, "scale": 1 / 600,
                                                      "current_scale": 1.0}})[ROW]
    assert "0.00195 (0.0625 / 2**margin 5)" in flag.reading
    assert flag.yaml_key.endswith("amax_history_len (shorter)")  # length not known


def test_margin_0_judges_as_before():
    assert [r for r, _ in _rules(HealthTracker(), 1 / 32)] == ["underflow_stale"]
    assert [r for r, _ in _rules(HealthTracker(), 1 / 8)] == ["underflow"]


def test_what_if_rows_are_judged_with_fp8_stats_recipe():
    tracker = HealthTracker(margin=0, whatif_recipe=DelayedRecipe(5, 16))
    assert [r for r, _ in _rules(tracker, 1 / 32, whatif=True)] == ["underflow"]
    tracker = HealthTracker(margin=0, whatif_recipe=DelayedRecipe(5, 16))
    assert [r for r, _ in _rules(tracker, 1 / 32)] == ["underflow_stale"]  # a cast row: margin 0


def test_recipes_from_hparams():
    hparams = {"fp8/recipe": {"scaling": "delayed", "margin": 3, "amax_history_len": 64},
               "callbacks": {"fp8_stats": {"recipe": {"scaling": "delayed", "margin": 2}}}}
    swap, whatif = recipes_from_hparams(hparams)
    assert swap == DelayedRecipe(3, 64)
    assert whatif is not None and whatif.margin == 2
    assert recipes_from_hparams({}) == (None, None)
    assert recipes_from_hparams({"fp8/recipe": {"margin": "x"}})[0] is None


@pytest.mark.slow
def test_a_margin_5_run_is_not_told_to_shorten_its_history(tmp_path, tiny_data, capsys):
    """A real tiny run at margin 5 (te_swap's emulated delayed scaling and fp8_stats' what-if):
    its report's underflow advice is not `amax_history_len (shorter)` for scales the margin
    set. A low underflow limit makes every layer's underflow a finding."""
    margin = {"scaling": "delayed", "amax_history_len": 16, "amax_compute_algo": "max",
              "margin": 5}
    run_tiny(tmp_path, tiny_data, {
        "variables": {"run_name": "m5"}, "max_duration": "6ba", "eval_interval": "6ba",
        "save_interval": "6ba", "algorithms": {"te_swap": {"fp8_recipe": margin}},
        "callbacks": {"fp8_stats": {"interval": "2ba", "max_underflow_pct": 0.01,
                                    "recipe": margin}}})
    folder = run_folder(tmp_path, "m5")
    rows = [m for _, m in read_jsonl(folder / "metrics.jsonl")]
    ratios = [v for row in rows for k, v in row.items()
              if k.startswith("fp8_scale_ratio/") and not row.get(k.replace("scale_ratio",
                                                                            "initial_scale"))]
    assert ratios and min(ratios) < 1 / 16  # what the old rule called stale
    capsys.readouterr()
    assert main(["report", str(folder), "--out", str(tmp_path / "out")]) == 0
    report = (tmp_path / "out" / "fp8_report.md").read_text()
    assert "underflow" in report and "margin 5" in report
    assert "amax_history_len (shorter)" not in report


def test_the_live_warnings_judge_what_if_rows_with_fp8_stats_recipe():
    """A layer not in FP8, watched with fp8_stats' delayed what-if at margin 5: its scale sits
    at 1/32 of the current scale by design, so half its input underflowing is no stale scale
    (before, the live warning advised a shorter amax_history_len, as the report did)."""
    import torch
    from torch import nn

    from foundry_fp8.monitor import FP8Monitor
    from foundry_fp8.options import MonitorConfig, Schedule

    torch.manual_seed(0)
    layer, warned = nn.Sequential(nn.Linear(16, 16)), []
    config = MonitorConfig(tensors=("activation",),
                           recipe={"scaling": "delayed", "margin": 5, "amax_history_len": 16})
    monitor = FP8Monitor(layer, config, on_warning=warned.append, schedule=Schedule(interval=1))
    assert monitor.tracker.whatif_recipe == DelayedRecipe(5, 16)
    x = torch.randn(16, 16)
    x[:8] *= 1e-7  # half the elements far below the amax: they underflow at any margin here
    for step in range(4):
        monitor.start_step(step)
        layer(x).sum().backward()
        monitor.finish_step()
    assert warned, "no underflow warning at all"
    assert not [w for w in warned if "amax_history_len" in w], warned
