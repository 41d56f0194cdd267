"""`foundry-fp8 report` on a real Composer run under NVTE_BACKWARD_OVERRIDE (tests/
test_override_monitor.py's one-block te_swap run): dY is never cast to FP8, so its what-if
numbers, logged per layer and marked `fp8_uncast/gradient/<layer>` = 1, are not judged by the
report either, as fp8_stats does not judge them; the heatmaps hatch them. Without the override
the same run's FP8 dY flushes 15 of 16 elements and the report flags it. Reference: torch's own
float8_e5m2 current-scaling cast (`_underflow_pct`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foundry_fp8.cli import main
from foundry_fp8.health import layer_key
from foundry_fp8.health.plots import UNCAST_NOTE, heatmap
from foundry_fp8.report.cli import make_report
from foundry_fp8.report.read import thresholds_from_hparams
from tests.test_override_monitor import BATCHES, LAYER, TOKENS, WEIGHTS, D, _fit, _underflow_pct

WANT = _underflow_pct(WEIGHTS.expand(TOKENS, D))


def _report(folder, capsys) -> str:
    capsys.readouterr()
    assert main(["report", str(folder), "--out", str(folder / "report")]) == 0
    return capsys.readouterr().out


def test_the_report_flags_the_cast_dy_without_the_override(tmp_path, monkeypatch, capsys):
    assert WANT == pytest.approx(93.75)
    _fit(tmp_path, monkeypatch, None)
    out = _report(tmp_path, capsys)
    assert "1 flagged" in out
    assert f"gradient: underflow_pct {WANT:g} %" in out


def test_the_report_leaves_the_uncast_dy_unjudged(tmp_path, monkeypatch, capsys):
    _, series = _fit(tmp_path, monkeypatch, "high_precision")
    marker = layer_key("uncast", "gradient", LAYER)
    logged = [m for m in series.values() if layer_key("underflow_pct", "gradient", LAYER) in m]
    assert len(logged) == BATCHES and all(m[marker] == 1.0 for m in logged)
    assert all(m[layer_key("underflow_pct", "gradient", LAYER)] == pytest.approx(WANT)
               for m in logged)
    assert not any(layer_key("uncast", t, LAYER) in m for m in series.values()
                   for t in ("activation", "weight"))
    out = _report(tmp_path, capsys)
    assert "0 flagged" in out and "Change:" not in out
    report = (tmp_path / "report" / "fp8_report.md").read_text()
    assert f"{WANT:g}" not in report and "93.7" not in report
    # the what-if numbers are still drawn, hatched, for what dropping the override would do
    run, flags, *_ = make_report(tmp_path, out=tmp_path / "again")
    assert flags == []
    assert run.values[(LAYER, "gradient", "underflow_pct")] == {
        s: pytest.approx(WANT) for s in range(BATCHES)}
    hm = heatmap(run, "underflow_pct", thresholds_from_hparams({}))
    [grad] = [p for p in hm.panels if p.tensor == "gradient"]
    assert grad.high_precision.all() and not any(
        p.high_precision.any() for p in hm.panels if p.tensor != "gradient")
    assert UNCAST_NOTE in hm.notes
    assert np.allclose(grad.matrix, WANT)


def test_nan_in_the_uncast_dy_is_still_flagged(tmp_path, monkeypatch, capsys):
    """NaN/Inf are in the high-precision dY: the report flags them as fp8_stats does."""
    weights = WEIGHTS.clone()
    weights[3] = float("nan")
    monkeypatch.setattr("tests.test_override_monitor.WEIGHTS", weights)
    _fit(tmp_path, monkeypatch, "high_precision")
    out = _report(tmp_path, capsys)
    flagged = out.split("flagged\n")[1].split("plots")[0]
    # weights[3] is NaN: dY's column 3 in each of the batch's TOKENS rows, at every step
    nans = int(torch.isnan(weights).sum()) * TOKENS
    assert (f"'{LAYER}' gradient: nan_count {nans} at step 0 ({nans} NaN and 0 Inf elements, "
            f"before any FP8 cast; {BATCHES} of {BATCHES} steps)") in flagged
    assert "underflow_pct" not in flagged


def test_the_logged_heatmaps_hatch_the_uncast_dy(tmp_path, monkeypatch):
    """fp8_stats' own W&B heatmaps mark the uncast rows as the report does."""
    import foundry_fp8.composer.stats as stats_module

    drawn = []
    render, stats = stats_module.render_heatmap, stats_module.FP8Stats
    monkeypatch.setattr(stats_module, "render_heatmap", lambda run, *a: drawn.append(run) or render(
        run, *a))

    class Imaging(stats):  # tests.test_override_monitor._fit logs no images
        def __init__(self, **kw):
            super().__init__(**{**kw, "image_interval": 1})

    monkeypatch.setattr(stats_module, "FP8Stats", Imaging)
    _fit(tmp_path, monkeypatch, "high_precision")
    run = drawn[-1]
    assert run.uncast == {(LAYER, "gradient", s) for s in run.steps} and len(run.steps) == BATCHES
    assert not run.high_precision
