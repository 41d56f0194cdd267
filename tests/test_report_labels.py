"""The report's heatmap of a run of one or two layers (fp8_stats' `layers` narrowed) keeps its
colour bar's label inside the picture: matplotlib's own extents of the drawn text."""

from __future__ import annotations

import pytest

from foundry_fp8.health import RunMetrics, Thresholds
from foundry_fp8.health.plots import draw_heatmap


@pytest.mark.parametrize("steps", [(0, 10, 20, 30), (2**40, 2**40 + 1000, 2**40 + 2000, 2**52)])
@pytest.mark.parametrize("tensors", [("weight",), ("activation", "weight", "gradient")])
def test_the_colour_bar_label_of_a_one_layer_heatmap_is_inside_the_picture(steps, tensors):
    run = RunMetrics()
    for n, step in enumerate(steps):
        run.add_table(step, {("blocks.0.ffn.down_proj", t): {"underflow_pct": 0.1 * n}
                             for t in tensors})
    figure = draw_heatmap(run, "underflow_pct", Thresholds())
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    label = figure.axes[-1].yaxis.label  # the colour bar's axes come last
    assert label.get_text().replace("\n", " ").startswith("% of finite nonzero elements")
    box, inside = label.get_window_extent(renderer), figure.bbox
    assert (box.x0 >= inside.x0 and box.x1 <= inside.x1 and box.y0 >= inside.y0
            and box.y1 <= inside.y1), (box, inside)
