"""The heatmaps fp8_stats logs during training (`health.raster`), checked pixel by pixel against
matplotlib's own colormap and norm objects built here from the documented scale: underflow in
percent on a symmetric-log scale from 0 to 100 % (linear below 0.01 %), YlOrRd, grey where a
cell was not logged or was cast with delayed scaling's initial scale."""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import pytest
from matplotlib.colors import SymLogNorm

from foundry_fp8.health import RunMetrics, Thresholds
from foundry_fp8.health.plots import heatmap
from foundry_fp8.health.raster import layout, raster, render_heatmap

GREY = (208, 208, 208)  # #d0d0d0
LINEARS = ("attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj")


def mpt_run(blocks: int, steps: int, seed: int = 0) -> RunMetrics:
    """An MPT-shaped run: `blocks` x 4 linears x 3 tensors, `steps` logging steps 100 apart, the
    weights' first cast on the initial scale."""
    rng = np.random.default_rng(seed)
    run = RunMetrics()
    layers = [f"model.transformer.blocks.{b}.{n}" for b in range(blocks) for n in LINEARS]
    for s in range(steps):
        run.add_table(100 * s, {
            (layer, tensor): {"underflow_pct": float(rng.uniform(0, 3)),
                              "cos_sim": float(1 - rng.uniform(0, 1e-3)),
                              "initial_scale": float(s == 0 and tensor == "weight")}
            for layer in layers for tensor in ("activation", "weight", "gradient")})
    return run


def pixel(image: np.ndarray, xy: tuple[int, int], at_x: int = 1, at_y: int = 1) -> tuple[int, ...]:
    x, y = xy
    return tuple(int(c) for c in image[y + at_y, x + at_x])


def expected_underflow_colour(value: float) -> tuple[int, ...]:
    norm = SymLogNorm(0.01, linscale=0.3, vmin=0.0, vmax=100.0, base=10)
    return tuple(int(c) for c in matplotlib.colormaps["YlOrRd"](norm(value), bytes=True)[:3])


@pytest.mark.parametrize("blocks, steps", [(2, 4), (24, 20)])  # tiny run (numbers in the cells), MPT-1B
def test_cells_have_the_colormaps_colour_and_initial_casts_are_grey(blocks, steps):
    run = mpt_run(blocks, steps)
    hm = heatmap(run, "underflow_pct", Thresholds())
    at = layout(hm)
    image = raster(hm)
    assert image.dtype == np.uint8 and image.shape == (at.height, at.width, 3)
    assert [p.tensor for p in hm.panels] == ["activation", "weight", "gradient"]
    layers = run.layers
    for panel, tensor in enumerate(("activation", "weight", "gradient")):
        for row, col in [(0, 1), (len(layers) - 1, steps - 1), (len(layers) // 2, steps // 2)]:
            value = run.values[(layers[row], tensor, "underflow_pct")][100 * col]
            # the cell's corner: clear of the number written in its middle
            assert pixel(image, at.cell(panel, row, col)) == expected_underflow_colour(value)
        # step 0: the weight's cast on the initial scale is grey, the others coloured
        first = pixel(image, at.cell(panel, 0, 0))
        value = run.values[(layers[0], tensor, "underflow_pct")][0]
        assert first == (GREY if tensor == "weight" else expected_underflow_colour(value))


def test_not_logged_cells_are_grey_and_nan_ones_blue():
    """A statistic logged as NaN (its tensor held NaN/Inf) is not a missing cell: grey for both
    made a diverged run's heatmaps read as if fp8_stats had stopped logging there."""
    run = RunMetrics()
    run.add_table(0, {("blocks.0.ffn", "gradient"): {"underflow_pct": 2.0},
                      ("blocks.1.ffn", "gradient"): {"underflow_pct": math.nan}})
    run.add_table(10, {("blocks.0.ffn", "gradient"): {"underflow_pct": 4.0}})
    hm = heatmap(run, "underflow_pct", Thresholds())
    at = layout(hm)
    image = render_heatmap(run, "underflow_pct", Thresholds())
    assert pixel(image, at.cell(0, 0, 1)) == expected_underflow_colour(4.0)
    assert pixel(image, at.cell(0, 1, 0)) == (0x1F, 0x4E, 0x9C)  # NaN
    assert pixel(image, at.cell(0, 1, 1)) == GREY  # not logged
    assert "blue: logged as NaN" in at.captions[0]


def test_colour_bar_runs_the_colormap_and_marks_the_threshold():
    run = mpt_run(2, 4)
    hm = heatmap(run, "underflow_pct", Thresholds(max_underflow_pct=5.0))
    at = layout(hm)
    image = raster(hm)
    bx = at.bar_x[-1]
    assert at.bar_x[:-1] == [None, None]  # one shared scale for the three tensor kinds
    assert [label for _, label in at.bar_ticks["gradient"]] == ["0", "0.01", "0.1", "1", "10", "100"]
    cmap = matplotlib.colormaps["YlOrRd"]
    assert pixel(image, (bx + 4, at.top), 0, 0) == tuple(cmap(1.0, bytes=True)[:3])
    assert pixel(image, (bx + 4, at.top + at.panel_h - 1), 0, 0) == tuple(cmap(0.0, bytes=True)[:3])
    norm = SymLogNorm(0.01, linscale=0.3, vmin=0.0, vmax=100.0, base=10)
    y = at.top + round((1 - float(norm(5.0))) * (at.panel_h - 1))
    assert pixel(image, (bx + 4, y), 0, 0) == (0, 0, 0)  # the black line at 5 %
    assert "black line: flagged beyond 5" in at.captions[1]


def test_every_layer_of_an_mpt_1b_is_named_and_more_layers_are_thinned():
    """Each named row has ink left of the panel, level with it; the image stays bounded."""
    run = mpt_run(24, 20)
    hm = heatmap(run, "cos_sim", Thresholds())
    at = layout(hm)
    image = raster(hm)
    assert hm.names[:2] == ["blocks.0.attn.Wqkv", "blocks.0.attn.out_proj"]  # prefix off
    assert "model.transformer." in hm.title
    assert at.row_ticks == list(range(96))
    for row in at.row_ticks:
        x, y = at.cell(0, row, 0)
        names = image[y + 2:y + at.cell_h - 2, 8:at.left - 4]
        assert names.min() < 100, row  # dark text there
    assert image.shape[0] <= 1400 and image.shape[1] <= 1200
    assert 4 <= len(at.col_ticks) < 20  # steps thinned to what fits

    many = layout(heatmap(mpt_run(75, 64), "underflow_pct", Thresholds()))  # 300 layers
    assert many.row_ticks[:3] == [0, 3, 6] and len(many.row_ticks) == 100
    assert many.height <= 1400 and many.width <= 1200


def test_numbers_in_the_cells_of_a_small_run_read_as_the_report_prints_them():
    run = mpt_run(2, 4)
    hm = heatmap(run, "cos_sim", Thresholds())
    at = layout(hm)
    value = run.values[(run.layers[3], "gradient", "cos_sim")][300]
    assert at.cells["gradient"][3][3] == f"{value:.5f}"
    assert at.cells["weight"][0][0] == ""  # grey cell, no number
    image = raster(hm)
    x, y = at.cell(2, 3, 3)
    cell = image[y:y + at.cell_h, x:x + at.cell_w]
    assert cell.min() < 60 and (cell.min(axis=2) < 60).sum() > 20  # black digits in it
    x, y = at.cell(1, 0, 0)
    assert (image[y:y + at.cell_h, x:x + at.cell_w] == GREY).all()  # nothing on grey
    assert not layout(heatmap(mpt_run(24, 20), "cos_sim", Thresholds())).cells  # too many


def test_rows_marked_high_precision_in_a_step_s_table_are_hatched_there_only():
    """What fp8_stats keeps per logging step (`add_table` of `{(layer, tensor): {stat: value}}`)
    can mark a row `high_precision` = 1, as `initial_scale` marks delayed scaling's first cast:
    those cells, and no other, get the hatching's 1-pixel lines (QA s15: a layer fp8_guard ran
    in high precision looked like an FP8 layer in the W&B images)."""
    from foundry_fp8.health.keys import HIGH_PRECISION
    from foundry_fp8.health.raster import FRAME

    run = RunMetrics()
    layers = ("blocks.0.attn.Wqkv", "blocks.1.ffn.down_proj")
    for s in range(4):
        run.add_table(10 * s, {(layer, "activation"): {
            "underflow_pct": 0.5, HIGH_PRECISION: float(layer == layers[1] and s >= 2)}
            for layer in layers})
    hm = heatmap(run, "underflow_pct", Thresholds())
    image, at = raster(hm), layout(hm)
    for i, layer in enumerate(layers):
        for j, step in enumerate(hm.steps):
            x, y = at.cell(0, i, j)
            inside = image[y + 1:y + at.cell_h - 1, x + 1:x + at.cell_w - 1]
            lines = int((inside == FRAME).all(axis=-1).sum())
            assert (lines > 0) == (layer == layers[1] and step >= 20), (layer, step, lines)
    assert "hatched: fp8_guard ran the layer in high precision" in " ".join(at.captions)
