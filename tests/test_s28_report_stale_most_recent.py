"""The stale-scale advice under a recipe whose scale follows the last amax alone (QA s28).
`amax_compute_algo: most_recent` (Megatron-LM's default, with `amax_history_len: 1`) takes TE's
scale from the latest amax whatever the history's length (TE v2.18
pytorch/quantization.py:1067-1075, `amax_history[0]`): no old spike stays in it, and a shorter
history changes nothing. The report told such a run "an old amax spike in the history keeps
the scale too small. Change: amax_history_len (shorter than 1024)" (or "shorter than 1" at
history 1); the cause is the previous step's amax, and current scaling the change."""

from __future__ import annotations

import json
import logging

import pytest

from foundry_fp8.cli import main
from foundry_fp8.health.rules import SPIKE_CHANGE, DelayedRecipe, HealthTracker
from foundry_fp8.recipe import FP8Recipe
from tests.tiny_run import run_folder, run_tiny

LAYER = "blocks.1.attn.out_proj"
KEY = f"/activation/{LAYER}"


def test_a_most_recent_run_s_stale_scale_is_told_current_scaling(tmp_path, tiny_data, capsys):
    """An outlier channel (x1e5) in the layer's input at steps 3-5: at step 6 the tensor is back
    to its size, cast with the scale of step 5's amax. The logged numbers show TE's rule (each
    step's scale is E4M3's 448 over the previous step's amax) and the stale premise (scale /
    current_scale under 1/16, underflow over 5 %); the report's change is current scaling."""
    from llmfoundry.registry import callbacks

    from foundry_fp8.fault import InjectOutlier

    callbacks.register("inject_outlier", func=InjectOutlier)
    live: list[str] = []  # fp8_stats' live warnings, which judge the same flags
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: live.append(record.getMessage())
    logger = logging.getLogger("foundry_fp8.composer.stats")
    logger.addHandler(handler)
    try:
        _run_most_recent(tmp_path, tiny_data)
    finally:
        logger.removeHandler(handler)
    [warned] = [line for line in live if "underflow" in line and "scale / current_scale" in line]
    assert "previous step's amax" in warned and "scaling: current" in warned, warned
    assert "amax_history_len (shorter" not in warned, warned
    folder = run_folder(tmp_path)
    logged = {
        r["step"]: r["metrics"]
        for r in map(json.loads, open(folder / "metrics.jsonl"))
        if f"fp8_scale{KEY}" in r["metrics"]
    }
    assert sorted(logged) == list(range(8))
    for step in range(2, 8):  # the scale follows the previous step's amax alone
        assert logged[step][f"fp8_scale{KEY}"] == pytest.approx(
            448 / logged[step - 1][f"fp8_amax{KEY}"], rel=1e-6
        )
    at6 = logged[6]
    assert at6[f"fp8_scale{KEY}"] / at6[f"fp8_current_scale{KEY}"] < 1 / 16
    assert at6[f"fp8_underflow_pct{KEY}"] > 5
    capsys.readouterr()
    assert main(["report", str(folder)]) == 0
    out = capsys.readouterr().out
    md = (folder / "fp8_report.md").read_text()
    [said] = [line for line in out.splitlines() if "scale / current_scale" in line]
    [row] = [
        line
        for line in md.splitlines()
        if line.startswith(f"| {LAYER} | activation | underflow_pct |") and "(step 6)" in line
    ]
    for text in (said, row):
        assert "previous step's amax" in text and "scaling: current" in text, text
        assert "amax_history_len (shorter" not in text, text


def _run_most_recent(tmp_path, tiny_data) -> None:
    """The tiny MPT under most_recent with outliers in LAYER's input at steps 3-5."""
    run_tiny(
        tmp_path,
        tiny_data,
        {
            "max_duration": "8ba",
            "eval_interval": "8ba",
            "save_interval": "8ba",
            "algorithms": {
                "te_swap": {
                    "fp8_recipe": {"amax_history_len": 1024, "amax_compute_algo": "most_recent"}
                }
            },
            "callbacks": {
                "fp8_stats": {
                    "interval": "1ba",
                    "layers": r"blocks\.1\.attn\.out_proj",
                    "tensors": ["activation"],
                },
                "inject_outlier": {"layer": LAYER, "start": 3, "stop": 6},
            },
        },
    )


@pytest.mark.parametrize(
    ("options", "history", "change"),
    [
        (
            {"amax_history_len": 16, "amax_compute_algo": "max"},
            16,
            "algorithms.te_swap.fp8_recipe.amax_history_len (shorter than 16)",
        ),
        ({"amax_history_len": 1, "amax_compute_algo": "max"}, 1, SPIKE_CHANGE),
        ({"amax_history_len": 1024, "amax_compute_algo": "most_recent"}, 1, SPIKE_CHANGE),
    ],
)
def test_the_stale_change_follows_the_amaxes_the_scale_is_taken_from(options, history, change):
    """A history of 16 under `max` keeps its advice; one scale from the last amax alone (history
    1, or most_recent at any length) is told current scaling."""
    recipe = DelayedRecipe.of(FP8Recipe.from_options({"scaling": "delayed", **options}))
    assert recipe.history_len == history
    tracker = HealthTracker(history_len=recipe.history_len)
    stats = {"underflow_pct": 30.0, "scale": 1.0, "current_scale": 1e4, "scale_ratio": 1e-4}
    [flag] = tracker.update(6, {(LAYER, "activation"): stats})[(LAYER, "activation")]
    assert flag.rule == "underflow_stale" and flag.yaml_key == change
