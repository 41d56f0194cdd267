"""A long run's heatmap (QA s23): `interval: 1` over 20k batches, or 300k batches at 100, is
thousands of logging steps in a panel of about 400 pixels. The report's matplotlib image was
sampled down (`interpolation="nearest"`), so a one-step overflow burst in one layer's dY showed
in no pixel (measured: 96 layers x 20,000 steps, a 3 % overflow at step 10,001: no pixel of its
colour). Now each column is the worst of its steps (`plots.bin_columns`), said in the caption."""

from __future__ import annotations

import math

import numpy as np

from foundry_fp8.health import RunMetrics, Thresholds
from foundry_fp8.health.keys import HIGH_PRECISION
from foundry_fp8.health.plots import (
    MAX_COLUMNS,
    MAX_ROWS,
    bin_columns,
    draw_heatmap,
    draw_series,
    heatmap,
    plain_labels,
)

LAYERS = ("blocks.0.attn.Wqkv", "blocks.0.ffn.down_proj", "blocks.1.ffn.down_proj")
STEPS = 3000  # a 300k-batch run at interval 100
BURSTS = {("blocks.0.ffn.down_proj", 1001): 3.0, ("blocks.1.ffn.down_proj", 2017): 40.0,
          ("blocks.0.attn.Wqkv", 2999): 0.5}


def long_run(bursts: dict[tuple[str, int], float]) -> RunMetrics:
    run = RunMetrics()
    for layer in LAYERS:
        for step in range(STEPS):
            run.add(step, layer, "gradient", "overflow_pct", bursts.get((layer, step), 0.001))
    run.tidy()
    return run


def test_bin_columns_keeps_the_worst_of_each_column():
    nan = math.nan
    matrix = np.array([[0.1, 3.0, 0.2, nan, nan], [0.5, nan, 0.4, 0.3, 9.0]])
    flag = np.array([[False, False, False, True, False], [False] * 5])
    worst, marked = bin_columns("overflow_pct", matrix, flag, per_column=2)
    assert worst.tolist()[0][:2] == [3.0, 0.2] and math.isnan(worst[0][2])  # no value: grey
    assert worst.tolist()[1] == [0.5, 0.4, 9.0]
    assert marked.tolist() == [[False, True, False], [False, False, False]]
    low, = bin_columns("cos_sim", np.array([[0.999, 0.95, 0.9999]]), per_column=3)
    assert low.tolist() == [[0.95]]
    far, = bin_columns("scale_ratio", np.array([[1.5, 0.1, 3.0, 1.0]]), per_column=2)
    assert far.tolist() == [[0.1, 3.0]]  # farthest from 1 on either side
    same = bin_columns("overflow_pct", matrix, flag, per_column=1)
    assert same[0] is matrix and same[1] is flag


def test_a_short_run_is_not_binned():
    run = long_run({})
    hm = heatmap(run, "overflow_pct", Thresholds())
    assert hm.per_column == 1 and hm.steps == run.steps
    assert hm.panels[0].matrix.shape == (len(LAYERS), STEPS)
    assert "each column" not in hm.notes


def test_binned_panel_holds_every_burst_nan_and_fallback():
    run = long_run(BURSTS)
    run.add(1500, "blocks.1.ffn.down_proj", "gradient", "overflow_pct", math.nan)
    run.add(2500, "blocks.0.attn.Wqkv", "gradient", HIGH_PRECISION, 1.0)
    hm = heatmap(run, "overflow_pct", Thresholds(), max_columns=MAX_COLUMNS)
    per = math.ceil(STEPS / MAX_COLUMNS)
    assert hm.per_column == per and hm.steps == list(range(0, STEPS, per))
    panel = hm.panels[0]
    assert panel.matrix.shape == (len(LAYERS), math.ceil(STEPS / per))
    for (layer, step), value in BURSTS.items():
        assert panel.matrix[LAYERS.index(layer), step // per] == value
    assert np.argwhere(panel.nan).tolist() == [[2, 1500 // per]]
    assert np.argwhere(panel.high_precision).tolist() == [[0, 2500 // per]]
    assert f"the worst of up to {per} logging steps" in hm.notes


def test_the_drawn_png_shows_each_one_step_burst():
    """Read back at the sink: the rendered pixels at each burst's cell have its colour."""
    figure = draw_heatmap(long_run(BURSTS), "overflow_pct", Thresholds())
    figure.canvas.draw()
    pixels = np.asarray(figure.canvas.buffer_rgba())[..., :3].astype(int)
    ax = figure.axes[0]
    image = ax.get_images()[0]
    per = math.ceil(STEPS / image.get_array().shape[1])  # the steps a drawn column holds
    for (layer, step), value in BURSTS.items():
        x, y = ax.transData.transform((step // per, LAYERS.index(layer)))
        expected = np.array(image.cmap(image.norm(value))[:3]) * 255
        got = pixels[int(pixels.shape[0] - y), int(x)]  # the pixel holding (x, y)
        assert np.abs(got - expected).max() <= 3, (layer, step, got, expected)


def test_scale_ratio_ticks_of_a_healthy_delayed_run_read_apart():
    """A healthy delayed-scaling run's scale_ratio stays within 1.000 to 1.010 (docs/report.md):
    its time-series axis labelled every tick `1`."""
    run = RunMetrics()
    for step in range(40):
        for stat, value in (("amax", 4.0 + step / 40), ("scale_ratio", 1.0 + step / 8000)):
            run.add(step, LAYERS[0], "weight", stat, value)
    run.tidy()
    figure = draw_series(run, [(LAYERS[0], "")])
    figure.canvas.draw()
    ax = next(ax for ax in figure.axes if ax.get_ylabel().startswith("scale_ratio"))
    low, high = ax.get_ylim()
    labels = [t.label1.get_text() for t in (*ax.yaxis.get_major_ticks(),
                                            *ax.yaxis.get_minor_ticks())
              if low <= t.get_loc() <= high and t.label1.get_text()]
    assert len(labels) >= 3 and len(set(labels)) == len(labels), labels
    assert plain_labels([1.0, 1.0011, 1.0012]) == ["1", "1.0011", "1.0012"]
    assert plain_labels([0.5, 2000.0, 5.7e7]) == ["0.5", "2000", "5.7e+07"]


LAYERS_MOE = [f"blocks.{i // 64}.experts.{i % 64}" for i in range(6000)]  # an MoE's experts
ROW_BURSTS = set(LAYERS_MOE[5::97])  # 62 layers with a one-step 3 % overflow


def _many_layers() -> RunMetrics:
    run = RunMetrics()
    for layer in LAYERS_MOE:
        for step in range(3):
            value = 3.0 if step == 1 and layer in ROW_BURSTS else 0.001
            run.add(step, layer, "gradient", "overflow_pct", value)
    run.tidy()
    return run


def test_more_layers_than_rows_are_binned_and_each_burst_is_drawn():
    """6,000 rows in about 2,400 pixels: sampled, 26 of the 62 bursts showed in the old PNG."""
    run = _many_layers()
    per = math.ceil(6000 / MAX_ROWS)
    hm = heatmap(run, "overflow_pct", Thresholds(), max_columns=MAX_COLUMNS, max_rows=MAX_ROWS)
    assert hm.per_row == per and len(hm.names) == len(hm.panels[0].matrix) == MAX_ROWS
    assert hm.names[1] == f"blocks.0.experts.{per}"
    assert f"each row: the worst of up to {per} layers" in hm.notes
    figure = draw_heatmap(run, "overflow_pct", Thresholds())
    figure.canvas.draw()
    pixels = np.asarray(figure.canvas.buffer_rgba())[..., :3].astype(int)
    ax = figure.axes[0]
    image = ax.get_images()[0]
    per = math.ceil(6000 / image.get_array().shape[0])  # the layers a drawn row holds
    # 3 % is red (247, 66, 38); the 0.001 % around it pale yellow (255, 254, 202); a row
    # at the frame blends with the black spine: any pixel of the row that is red shows it
    assert np.array(image.cmap(image.norm(3.0))[:3]).round(2).tolist() == [0.97, 0.26, 0.15]
    unseen = []
    for layer in sorted(ROW_BURSTS):
        row = LAYERS_MOE.index(layer) // per
        (x, top), (_, bottom) = ax.transData.transform([(1, row - 0.5), (1, row + 0.5)])
        span = pixels[int(pixels.shape[0] - top):int(pixels.shape[0] - bottom) + 1, int(x)]
        if not ((span[:, 0] > 150) & (span[:, 2] < 120)).any():  # no pixel of its row shows it
            unseen.append(layer)
    assert not unseen, unseen
