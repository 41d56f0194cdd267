"""The heatmaps `fp8_stats` logs during training, drawn straight into pixels.

A matplotlib figure (layout, ticks, colour bar, a text artist per cell) costs 0.5-2.5 s per
statistic: a picture step took 4 s on the tiny run, 27 of its training steps. Here the same
`plots.Heatmap` (norms, matrices, names, steps: one home) is coloured as whole arrays by the
colormap and norm objects of `matplotlib.colors`, each cell becomes a nearest-neighbour block
of pixels, and the labels are set with Pillow (a dependency of matplotlib, and what W&B encodes
images with) in matplotlib's own DejaVu Sans: about 0.1 s per statistic. The report keeps the
matplotlib figures. No torch; numpy, matplotlib and Pillow are imported only when drawing.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundry_fp8.health.history import RunMetrics
from foundry_fp8.health.plots import (
    NAN_CELL,
    Formats,
    Heatmap,
    Panel,
    heatmap,
    tick_indices,
)
from foundry_fp8.health.thresholds import Thresholds

PAD = 8  # around the picture and between its parts, pixels
GAP = 12  # between panels
TEXT, SMALL, TITLE = 12, 10, 14  # font sizes, pixels
# All layers' rows together at most (each row 3-22 px): an MPT-1B's 96 layers get 12 px each,
# each with its name; more layers get every other name, or fewer.
ROWS_PX = 1200
STEPS_PX = 240  # a panel's width without numbers in the cells (each column 3-40 px)
BAR_PX = 14  # the colour bar's width
INK = (0, 0, 0)
HATCH_PX = 6  # the hatching of fp8_guard's high-precision cells: a 1-pixel "/" every 6 pixels
FRAME = (110, 110, 110)
NAN_RGB = tuple(int(NAN_CELL[i:i + 2], 16) for i in (1, 3, 5))


@functools.cache
def _font(size: int) -> Any:
    import matplotlib
    from PIL import ImageFont

    # Pillow's own layout: a quarter faster than libraqm's, and the same wherever it runs
    return ImageFont.truetype(
        str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"), size,
        layout_engine=ImageFont.Layout.BASIC)


def render_heatmap(run: RunMetrics, stat: str, thresholds: Thresholds,
                   formats: Formats | None = None) -> Any:
    """`plots.heatmap` as an RGB uint8 array [height, width, 3] (what Composer's log_images
    takes): a title, one panel per tensor kind (layers down, logging steps across, thinned
    labels; titled with `formats`), the colour bar with its numbers and the threshold's black
    line, and a caption."""
    return raster(heatmap(run, stat, thresholds, formats))


def bar_ticks(panel: Panel) -> list[tuple[float, str]]:
    """The colour bar's (value, label) ticks: the panel's own, else decades (log) or about 5
    round numbers, and the two ends where fewer than 3 fall inside."""
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import LogLocator, MaxNLocator

    if panel.ticks is not None:
        return [(t, f"{t:g}") for t in panel.ticks]
    low, high = panel.norm.vmin, panel.norm.vmax
    locator = LogLocator() if isinstance(panel.norm, LogNorm) else MaxNLocator(5)
    ticks = [float(t) for t in locator.tick_values(low, high) if low <= t <= high]
    return [(t, f"{t:.3g}") for t in (ticks if len(ticks) >= 3 else sorted({low, *ticks, high}))]


@dataclass(frozen=True)
class Layout:
    """Where everything goes, in pixels (x right, y down)."""

    width: int
    height: int
    n_layers: int
    n_steps: int
    cell_w: int
    cell_h: int
    top: int  # the panels' first pixel row
    panel_x: list[int]  # each panel's first pixel column
    bar_x: list[int | None]  # each panel's colour bar, if it has one
    left: int  # the layer names end here
    row_ticks: list[int]  # the layers named
    col_ticks: list[int]  # the steps named
    cells: dict[str, list[list[str]]]  # the numbers written into cells, per tensor
    bar_ticks: dict[str, list[tuple[float, str]]]
    captions: list[str]

    def cell(self, panel: int, row: int, col: int) -> tuple[int, int]:
        """The top left pixel (x, y) of a cell."""
        return self.panel_x[panel] + col * self.cell_w, self.top + row * self.cell_h

    def bar_y(self, norm: Any, value: float) -> int:
        """The pixel row of `value` on a colour bar running from 1 (top) to 0."""
        level = min(max(float(norm(value)), 0.0), 1.0)
        return self.top + round((1.0 - level) * (self.panel_h - 1))

    @property
    def panel_w(self) -> int:
        return self.cell_w * self.n_steps

    @property
    def panel_h(self) -> int:
        return self.cell_h * self.n_layers


def layout(hm: Heatmap) -> Layout:
    """Cell sizes from the numbers of layers and steps (and the numbers written in cells), names
    thinned to what fits, columns of names | panel (| bar) ... | bar."""
    text, small, title = _font(TEXT), _font(SMALL), _font(TITLE)
    n_layers, n_steps = len(hm.names), len(hm.steps)
    cells = {p.tensor: [[hm.cell_text(v) if math.isfinite(v) else "" for v in row]
                        for row in p.matrix.tolist()] for p in hm.panels} if hm.annotate else {}
    cell_h = min(max(ROWS_PX // max(n_layers, 1), 3), 22)
    widest = max((number_width(s) for rows in cells.values() for row in rows for s in row),
                 default=0.0)
    cell_w = math.ceil(widest) + 8 if cells else min(max(STEPS_PX // max(n_steps, 1), 3), 40)
    heading = max(text.getlength(p.title) for p in hm.panels)
    cell_w = max(cell_w, math.ceil((heading + 4) / max(n_steps, 1)))  # the panel's title fits
    panel_w, panel_h = cell_w * n_steps, cell_h * n_layers
    row_ticks = tick_indices(n_layers, panel_h // (SMALL + 2))
    col_ticks = tick_indices(n_steps, int(panel_w // (max(small.getlength(str(s)) for s in hm.steps) + 8)))
    left = PAD + math.ceil(max(small.getlength(hm.names[i]) for i in row_ticks)) + 6
    ticks = {p.tensor: bar_ticks(p) for p in hm.panels}
    panel_x: list[int] = []
    bar_x: list[int | None] = []
    x = left
    for p in hm.panels:
        panel_x.append(x)
        x += panel_w + GAP
        if not hm.shared_scale or p is hm.panels[-1]:
            bar_x.append(x)
            x += BAR_PX + 6 + math.ceil(max(small.getlength(label) for _, label in ticks[p.tensor])) + GAP
        else:
            bar_x.append(None)
    top = PAD + TITLE + 8 + TEXT + 6
    captions = ["x: logging step, y: layer; " + hm.notes,
                "colour: " + hm.label + (f"; {hm.threshold_note}" if hm.threshold_note else "")]
    width = max(x + PAD - GAP, *(math.ceil(text.getlength(c)) + 2 * PAD for c in captions),
                math.ceil(title.getlength(hm.title)) + 2 * PAD)
    height = top + panel_h + 4 + SMALL + 10 + 2 * (TEXT + 4) + PAD
    return Layout(width, height, n_layers, n_steps, cell_w, cell_h, top, panel_x, bar_x, left,
                  row_ticks, col_ticks, cells, ticks, captions)


def raster(hm: Heatmap) -> Any:
    """Draw `hm` (see `render_heatmap`)."""
    import numpy as np
    from PIL import Image, ImageDraw

    at = layout(hm)
    text, small, title = _font(TEXT), _font(SMALL), _font(TITLE)
    canvas = np.full((at.height, at.width, 3), 255, dtype=np.uint8)
    top, panel_w, panel_h = at.top, at.panel_w, at.panel_h
    levels = []
    for p, x0, bx in zip(hm.panels, at.panel_x, at.bar_x, strict=True):
        levels.append(p.norm(np.ma.masked_invalid(p.matrix)))  # masked: the colormap's grey
        rgb = hm.cmap(levels[-1], bytes=True)[..., :3]
        canvas[top:top + panel_h, x0:x0 + panel_w] = np.repeat(np.repeat(rgb, at.cell_h, 0),
                                                               at.cell_w, 1)
        nan = np.repeat(np.repeat(p.nan, at.cell_h, 0), at.cell_w, 1)
        canvas[top:top + panel_h, x0:x0 + panel_w][nan] = NAN_RGB
        hatched = np.repeat(np.repeat(p.high_precision, at.cell_h, 0), at.cell_w, 1)
        ys, xs = np.indices(hatched.shape)
        canvas[top:top + panel_h, x0:x0 + panel_w][hatched & ((xs + ys) % HATCH_PX == 0)] = FRAME
        _frame(canvas, x0, top, panel_w, panel_h)
        if bx is not None:
            ramp = hm.cmap(np.linspace(1.0, 0.0, panel_h), bytes=True)[:, :3]
            canvas[top:top + panel_h, bx:bx + BAR_PX] = ramp[:, None, :]
            _frame(canvas, bx, top, BAR_PX, panel_h)
            if p.limit is not None:
                y = at.bar_y(p.norm, p.limit)
                canvas[max(y - 1, top):y + 2, bx - 3:bx + BAR_PX + 3] = INK

    for k, p in enumerate(hm.panels if at.cells else []):  # the numbers, blended at once
        ink = np.zeros((panel_h, panel_w), dtype=np.float32)
        for i, row in enumerate(at.cells[p.tensor]):
            for j, label in enumerate(row):
                _stamp(ink, (j + 0.5) * at.cell_w, (i + 0.5) * at.cell_h, label)
        dark = hm.dark(np.ma.filled(levels[k], 0.5))  # white digits on dark cells
        white = np.repeat(np.repeat(dark, at.cell_h, 0), at.cell_w, 1)[..., None]
        ink = np.minimum(ink, 1.0)[..., None]
        x0 = at.panel_x[k]
        cells = canvas[top:top + panel_h, x0:x0 + panel_w]
        cells[:] = (cells * (1.0 - ink) + 255.0 * ink * white).round()
    image = Image.fromarray(canvas)
    draw = ImageDraw.Draw(image)
    draw.text((PAD, PAD), hm.title, fill=INK, font=title)
    for i in at.row_ticks:
        y = at.cell(0, i, 0)[1] + at.cell_h / 2
        draw.text((at.left - 6, y), hm.names[i], fill=INK, font=small, anchor="rm")
    for k, (p, x0, bx) in enumerate(zip(hm.panels, at.panel_x, at.bar_x, strict=True)):
        draw.text((x0 + panel_w / 2, top - 4), p.title, fill=INK, font=text, anchor="md")
        for j in at.col_ticks:
            x = at.cell(k, 0, j)[0] + at.cell_w / 2
            draw.text((x, top + panel_h + 4), str(hm.steps[j]), fill=INK, font=small, anchor="mt")
        if bx is not None:
            for value, label in at.bar_ticks[p.tensor]:
                y = at.bar_y(p.norm, value)
                draw.line([(bx + BAR_PX, y), (bx + BAR_PX + 3, y)], fill=INK)
                draw.text((bx + BAR_PX + 6, y), label, fill=INK, font=small, anchor="lm")
    below = top + panel_h + 4 + SMALL + 10
    for k, caption in enumerate(at.captions):
        draw.text((PAD, below + k * (TEXT + 4)), caption, fill=INK, font=text)
    return np.asarray(image).copy()


#: What a cell's number is made of (`Heatmap.cell_text`: `.2g`, `.5f`).
NUMBER_GLYPHS = "0123456789.-+e"


@functools.cache
def _glyphs() -> dict[str, tuple[Any, int, int, float]]:
    """Each NUMBER_GLYPHS character in SMALL type as (coverage 0-1 [h, w], left and top offset
    from the pen at the text's vertical middle, advance): typesetting every cell's number with
    Pillow costs 0.15 ms each, half of a small run's picture step."""
    import numpy as np
    from PIL import Image, ImageDraw

    font = _font(SMALL)
    _, top0, _, bottom0 = font.getbbox("0")
    middle = (top0 + bottom0) / 2
    glyphs = {}
    for ch in NUMBER_GLYPHS:
        left, top, right, bottom = font.getbbox(ch)
        mask = Image.new("L", (max(right - left, 1), max(bottom - top, 1)))
        ImageDraw.Draw(mask).text((-left, -top), ch, font=font, fill=255)
        glyphs[ch] = (np.asarray(mask, dtype=np.float32) / 255.0, left, round(top - middle),
                      font.getlength(ch))
    return glyphs


def number_width(label: str) -> float:
    """A cell number's width in pixels as `_stamp` sets it."""
    glyphs = _glyphs()
    return sum(glyphs[ch][3] for ch in label)


def _stamp(ink: Any, cx: float, cy: float, label: str) -> None:
    """Add `label`'s coverage (NUMBER_GLYPHS only), centred on (cx, cy), to `ink`."""
    glyphs = _glyphs()
    pen = cx - number_width(label) / 2
    for ch in label:
        alpha, left, top, advance = glyphs[ch]
        x, y = round(pen) + left, round(cy) + top
        ink[y:y + alpha.shape[0], x:x + alpha.shape[1]] += alpha
        pen += advance


def _frame(canvas: Any, x: int, y: int, w: int, h: int) -> None:
    canvas[y - 1, x - 1:x + w + 1] = FRAME
    canvas[y + h, x - 1:x + w + 1] = FRAME
    canvas[y - 1:y + h + 1, x - 1] = FRAME
    canvas[y - 1:y + h + 1, x + w] = FRAME
