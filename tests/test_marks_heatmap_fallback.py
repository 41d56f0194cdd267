"""The heatmaps fp8_stats logs to W&B hatch the steps fp8_guard ran a layer in high precision (and
a layer with no FP8 cast at all), as the report's do: a real Composer run (tests/test_guard_flops.py's model, whose faulty block
falls back at its second judged step), the images read pixel by pixel. Reference: the guard's
own fallback record (the step it decided; the layer runs in high precision from the next
batch) and the documented hatching, a 1-pixel grey (110, 110, 110) "/" every 6 pixels."""

from __future__ import annotations

import numpy as np

import foundry_fp8.composer.stats as stats_module
from foundry_fp8.health.plots import heatmap
from foundry_fp8.health.raster import layout
from tests.test_guard_flops import FAULTY, INTERVAL, _fit

HATCH = (110, 110, 110)


def _hatched(image: np.ndarray, at, panel: int, row: int, col: int) -> float:
    """The share of a cell's pixels on the hatching's diagonals (panel coordinates) that are
    the hatching's grey."""
    x, y = at.cell(panel, row, col)
    ys, xs = np.indices((at.cell_h, at.cell_w))
    on = (xs + x - at.panel_x[panel] + ys + y - at.top) % 6 == 0
    block = image[y:y + at.cell_h, x:x + at.cell_w]
    return float((block[on] == HATCH).all(axis=1).mean())


def test_the_logged_heatmaps_hatch_a_fallen_layers_steps(tmp_path, caplog, monkeypatch):
    drawn = []
    render = stats_module.render_heatmap

    def capture(run, stat, thresholds, formats=None):
        image = render(run, stat, thresholds, formats)
        drawn.append((run, stat, thresholds, formats, image))
        return image

    monkeypatch.setattr(stats_module, "render_heatmap", capture)
    guard, _, _ = _fit(tmp_path, 0.5, caplog, image_interval=INTERVAL)
    decided = guard.core.fallbacks[FAULTY].step
    run, stat, thresholds, formats, image = next(d for d in reversed(drawn)
                                                 if d[1] == "underflow_pct")
    assert run.steps == list(range(0, 12, INTERVAL)) and decided == 4
    hm = heatmap(run, stat, thresholds, formats)
    at = layout(hm)
    assert [p.tensor for p in hm.panels] == ["activation", "weight", "gradient"]
    faulty = run.layers.index(FAULTY)
    # the stand-in TE module computes in high precision outside TE's autocast: what-if numbers at
    # every step, hatched as a layer with no FP8 cast (fp8_high_precision)
    native = run.layers.index("module.native")
    for panel in range(len(hm.panels)):
        for row, layer in enumerate(run.layers):
            for col, step in enumerate(run.steps):
                share = _hatched(image, at, panel, row, col)
                if (row == faulty and step > decided) or row == native:
                    assert share > 0.5, (layer, step, share)
                else:
                    assert share == 0.0, (layer, step, share)


def test_a_resumed_run_keeps_the_hatching_of_its_saved_steps():
    """The heatmaps' history in a checkpoint (`state_dict()['heatmaps']`) keeps the marker: a
    resumed run hatches the steps before it as the first run did."""
    saved = [[6, [["blocks.0", "weight", {"underflow_pct": 3.0, "high_precision": 1.0}],
                  ["blocks.1", "weight", {"underflow_pct": 0.0}]], {"weight": ["E4M3"]}]]
    [(step, rows, _)] = stats_module._heatmap_history(saved, {("blocks.0", "weight"),
                                                              ("blocks.1", "weight")})
    assert step == 6 and rows == {("blocks.0", "weight"): {"underflow_pct": 3.0,
                                                           "high_precision": 1.0},
                                  ("blocks.1", "weight"): {"underflow_pct": 0.0}}
