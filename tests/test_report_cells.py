"""The numbers the report's heatmaps write into their cells (up to 12 logging steps) stay apart:
matplotlib's own text extents, measured on the drawn figure, do not overlap along a row."""

from __future__ import annotations

from foundry_fp8.health import Thresholds, layer_key
from foundry_fp8.health.history import collect
from foundry_fp8.health.plots import draw_heatmap


def test_cosines_written_in_the_cells_do_not_overlap():
    """QA s15: the tiny run's cos_sim heatmap (8 logging steps, 3 panels) ran `0.99965` into
    `0.99965` along every row."""
    layers = [f"blocks.{b}.{n}" for b in range(2) for n in ("attn.Wqkv", "ffn.down_proj")]
    run = collect((10 * s, {layer_key("cos_sim", t, layer): 0.99965 - 1e-5 * s
                            for layer in layers for t in ("activation", "weight", "gradient")})
                  for s in range(12))
    figure = draw_heatmap(run, "cos_sim", Thresholds())
    renderer = figure.canvas.get_renderer()
    figure.draw(renderer)
    for ax in figure.axes[:3]:
        rows: dict[float, list] = {}
        for t in ax.texts:
            rows.setdefault(t.get_position()[1], []).append(t.get_window_extent(renderer))
        assert len(rows) == len(layers) and all(len(r) == 12 for r in rows.values())
        for boxes in rows.values():
            boxes.sort(key=lambda b: b.x0)
            gaps = [right.x0 - left.x1 for left, right in zip(boxes, boxes[1:], strict=False)]
            assert min(gaps) > 0, min(gaps)
