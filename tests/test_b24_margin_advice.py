"""The persistent-overflow advice raises te_swap's `margin` by one from the run's own (QA B s24).
TE's delayed scale is `(fp8_max / amax) / 2**margin` (common/recipe/__init__.py:247 v2.18;
delayed_scaling.cu:300, 331), so a tensor growing by g per step casts with scale_ratio
g / 2**margin: the rule flags it at g in (1.036, 2) * 2**margin, and only margin + 1 brings the
ratio under 1. A run already at `margin: 1` was told `margin: 1`: followed, it changed nothing.
The steps are cast with the emulation's own delayed-scaling update (`numerics`, TE's kernel)."""

from __future__ import annotations

import json

import torch
import yaml

from foundry_fp8.cli import main
from foundry_fp8.health import HealthTracker, layer_key
from foundry_fp8.jsonl import JsonlSink
from foundry_fp8.numerics import delayed_scale_update, tensor_stats

LAYER = "blocks.0.ffn.up_proj"
SWAP_MARGIN = "algorithms.te_swap.fp8_recipe.margin"


def steps(growth: float, margin: int, n: int = 8) -> list[dict[str, float]]:
    """One activation growing by `growth` per step, cast under delayed scaling (history 16,
    max) with `margin`; the first cast (initial scale 1) left out, as the rules leave it."""
    torch.manual_seed(0)
    base = torch.randn(64, 64)
    history, scale = torch.zeros(16, 1), torch.ones(1)
    rows = []
    for t in range(n):
        x = base * growth**t
        rows.append(tensor_stats(x, "e4m3", scale=scale))
        history[0] = x.abs().max()
        history, scale = delayed_scale_update(history, scale, 448.0, "max", margin)
    return rows[1:]


def persistent(rows: list[dict[str, float]], margin: int) -> list[str]:
    """The changes the overflow_persistent flags of these steps advise."""
    tracker = HealthTracker(margin=margin)
    for step, row in enumerate(rows, 1):
        tracker.update(step, {(LAYER, "activation"): row})
    return [f.yaml_key for f in tracker.flags if f.rule == "overflow_persistent"]


def followed(change: str) -> int:
    [(path, value)] = yaml.safe_load(change).items()
    assert path == SWAP_MARGIN
    return value


def test_following_the_margin_advice_clears_the_overflow():
    for growth, margin in ((1.5, 0), (3.0, 1)):
        rows = steps(growth, margin)
        assert all(abs(r["scale_ratio"] - growth / 2**margin) < 1e-3 for r in rows[1:])
        changes = persistent(rows, margin)
        assert changes and set(changes) == {f"{SWAP_MARGIN}: {margin + 1}"}
        after = steps(growth, followed(changes[0]))
        assert max(r["overflow_pct"] for r in after) == 0 and not persistent(after, margin + 1)
    # the old advice at margin 1: the same run again, flagged again
    assert persistent(steps(3.0, 1), 1)


def test_report_advises_from_the_runs_logged_recipe(tmp_path, capsys):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    for step, row in enumerate(steps(3.0, 1), 1):
        sink.write(step, {layer_key(stat, "activation", LAYER): v for stat, v in row.items()})
    (tmp_path / "hparams.json").write_text(json.dumps({"fp8/recipe": {
        "scaling": "delayed", "amax_history_len": 16, "amax_compute_algo": "max", "margin": 1}}))
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    [line] = [s for s in capsys.readouterr().out.splitlines() if "overflow_pct" in s and "Change:" in s]
    assert line.endswith(f"Change: {SWAP_MARGIN}: 2"), line
