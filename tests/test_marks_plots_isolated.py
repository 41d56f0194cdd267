"""A long series (more than MARKED_POINTS logging steps, drawn as a line without a marker per
step) still shows a point that has no drawable neighbour (NaN on both sides): a line joins
nothing to it, so without its marker it would not be drawn at all. Checked in the rendered
pixels around the point, against matplotlib's C0 colour."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.colors import to_rgb

from foundry_fp8.health import layer_key
from foundry_fp8.health.history import collect
from foundry_fp8.health.plots import MARKED_POINTS, draw_series

LAYER = "blocks.0.attn.Wqkv"
STEPS = MARKED_POINTS + 50
ALONE = 120  # the one amax logged between NaN gaps


def _amax(step: int) -> float:
    if step < 50:
        return 2.0 + step / 50  # a joined line
    return 5.0 if step == ALONE else math.nan


def _near_c0(figure, ax, x: float, y: float, radius: int = 3) -> bool:
    figure.canvas.draw()
    image = np.asarray(figure.canvas.buffer_rgba())[..., :3].astype(int)
    px, py = ax.transData.transform((x, y))
    row, col = round(image.shape[0] - py), round(px)
    patch = image[row - radius:row + radius + 1, col - radius:col + radius + 1]
    c0 = np.array([round(255 * c) for c in to_rgb("C0")])
    return bool((np.abs(patch - c0).sum(axis=-1) < 40).any())


def test_an_isolated_point_of_a_long_series_is_marked():
    run = collect((step, {layer_key("amax", "weight", LAYER): _amax(step)})
                  for step in range(STEPS))
    figure = draw_series(run, [(LAYER, "")])
    [ax] = [ax for ax in figure.axes if ax.get_lines()]
    [line] = ax.get_lines()
    assert len(line.get_xdata()) == STEPS
    assert _near_c0(figure, ax, ALONE, 5.0)
    assert line.get_markevery() == [ALONE]  # the joined steps keep no markers
