"""Pictures of a run's FP8 statistics: layers x steps heatmaps and amax/scale time series, as
matplotlib figures for `foundry-fp8 report` (PNG files). What a heatmap shows (`heatmap`) is
also what `fp8_stats` draws for W&B, in pixels (`health.raster`).

Everything before the drawing is plain data (tested exactly); matplotlib is imported only when
drawing, with the Agg canvas (no pyplot state). No torch.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundry_fp8.blocks import block_index
from foundry_fp8.health.history import RunMetrics, heatmap_matrix, series, worst_layers
from foundry_fp8.health.keys import direction
from foundry_fp8.health.specs import spec
from foundry_fp8.health.table import bounded, one_line, short_names
from foundry_fp8.health.thresholds import Thresholds
from foundry_fp8.recipe import FP8Recipe

#: Tensor kinds drawn side by side (fp8_stats logs 3; more come only from another file's keys).
MAX_PANELS = 6
#: Layers in the time-series plot (its legend has a line for each).
MAX_SERIES_LAYERS = 20
#: Per tensor name, the FP8 formats its rows were cast in (`E4M3`, `E5M2`); a tensor left out
#: gets no format in its panel's title.
Formats = Mapping[str, Collection[str]]


def recipe_formats(recipes: Iterable[FP8Recipe], tensors: Iterable[str]) -> dict[str, set[str]]:
    """The formats `recipes` (every recipe that cast some of the rows) give each tensor name:
    `FP8Recipe.format_for` its pass (`keys.direction`)."""
    recipes = list(recipes)
    return {tensor: {r.format_for(direction(tensor)).upper() for r in recipes}
            for tensor in tensors}


def panel_title(kind: str, formats: Collection[str] | None) -> str:
    """A panel's tensor kind with the formats its rows were cast in (`gradient (E5M2)`,
    `gradient (E4M3 or E5M2)`), or alone where they are not known."""
    return f"{kind} ({' or '.join(sorted(formats))})" if formats else kind


def choose_layers(run: RunMetrics, match: Callable[[str], bool] | None = None,
                  first_flagged: tuple[str, int] | None = None) -> list[tuple[str, str]]:
    """(layer, why) for the time-series plot, in model order: the layers `match` takes (why:
    ""), or else the first layer of the first block, the last layer of the last block, the
    layer with the worst underflow and `first_flagged`'s (layer, step): where a divergence
    began, whose amax is the one to see move first."""
    if match is not None:
        return [(layer, "") for layer in run.layers if match(layer)]
    numbered = [layer for layer in run.layers if block_index(layer) is not None]
    if numbered:
        first_block = min(block_index(layer) for layer in numbered)
        last_block = max(block_index(layer) for layer in numbered)
        first = next(layer for layer in numbered if block_index(layer) == first_block)
        last = [layer for layer in numbered if block_index(layer) == last_block][-1]
    else:
        first, last = run.layers[0], run.layers[-1]
    reasons: dict[str, list[str]] = {first: ["first block"]}
    reasons.setdefault(last, []).append("last block")
    for w in worst_layers(run, "underflow_pct", n=1):
        reasons.setdefault(w.layer, []).append(f"most underflow: {w.mean:.3g} % of {w.tensor} on average")
    if first_flagged is not None:
        reasons.setdefault(first_flagged[0], []).append(f"first flagged, at step {first_flagged[1]}")
    return [(layer, "; ".join(reasons[layer])) for layer in run.layers if layer in reasons]


def common_prefix(layers: list[str]) -> str:
    """The dotted prefix all layer names share, kept short of a block number (so labels read
    `blocks.0.attn.Wqkv`, not `0.attn.Wqkv`); empty for a single layer."""
    if len(layers) < 2:
        return ""
    split = [layer.split(".") for layer in layers]
    shared = []
    for parts in zip(*(s[:-1] for s in split), strict=False):
        if len(set(parts)) != 1:
            break
        shared.append(parts[0])
    while shared and any(len(s) > len(shared) and s[len(shared)].isdigit() for s in split):
        shared.pop()
    return ".".join(shared) + "." if shared else ""


def log_limits(lines: list[tuple[list[int], list[float]]]) -> tuple[float, float, int] | None:
    """Log-axis limits leaving out the first logged step when it lies more than 10x outside the
    other steps' range: delayed scaling runs step 0 on the initial scale 1.0, which would
    flatten every later point. (low, high, the step left off the scale), or None: no need."""
    points = [(s, v) for steps, values in lines for s, v in zip(steps, values, strict=True)
              if 0 < v < math.inf]
    first = min((s for s, _ in points), default=None)
    rest = [v for s, v in points if s != first]
    if not rest:
        return None
    low, high = min(rest), max(rest)
    if all(low / 10 <= v <= high * 10 for s, v in points if s == first):
        return None
    return low / 1.5, high * 1.5, first


def tick_indices(n: int, max_ticks: int) -> list[int]:
    """At most about `max_ticks` evenly spaced positions out of `n`, always including the first."""
    stride = max(1, math.ceil(n / max(1, max_ticks)))
    return list(range(0, n, stride))


#: Magnitudes plotted within [1 / PLOT_MAX, PLOT_MAX] (FP8 statistics of float32 tensors lie
#: well inside): a log axis or colour bar pads its limits and puts ticks up to about twice its
#: span beyond them, which must stay inside float64 (1.8e308, and 2e-287, below which a colour
#: bar takes its limits for equal and fails).
PLOT_MAX = 1e80


def text(label: str) -> str:
    """A name as matplotlib prints it literally (`$` would start mathtext, which can fail)."""
    return one_line(label).replace("$", r"\$")


def drawable(values: Any) -> Any:
    """`values` (NaN kept) with magnitudes clipped into what matplotlib can scale."""
    import numpy as np

    array = np.asarray(values, dtype=float)
    magnitude = np.clip(np.abs(array), 1 / PLOT_MAX, PLOT_MAX)
    return np.where(array == 0, 0.0, np.sign(array) * magnitude)


PCT_LINEAR_BELOW = 0.01  # percent; log colour steps above it, so 0.1 % and 10 % both show


def _cos_forward(x: Any) -> Any:
    import numpy as np

    return -np.log10(np.clip(1.0 - np.asarray(x, dtype=float), 1e-7, None))


def _cos_inverse(y: Any) -> Any:
    import numpy as np

    return 1.0 - 10.0 ** -np.asarray(y, dtype=float)


def _norm(stat: str, values: list[float], thresholds: Thresholds) -> tuple[Any, float | None, list[float] | None]:
    """Colour normalisation, the threshold to mark on the colour bar and its ticks.

    Percentages always span 0-100 % (log above 0.01 %), and cosine similarity runs on a log scale
    of 1 - cos (0.99, 0.999, ...), so a colour means the same in every report and small but real
    differences stay visible.
    """
    from matplotlib.colors import FuncNorm, LogNorm, Normalize, SymLogNorm

    finite = [v for v in values if math.isfinite(v)]
    if stat in ("underflow_pct", "overflow_pct"):
        limit = thresholds.max_underflow_pct if stat == "underflow_pct" else thresholds.max_overflow_pct
        norm = SymLogNorm(PCT_LINEAR_BELOW, linscale=0.3, vmin=0.0, vmax=100.0, base=10)
        return norm, limit if limit > 0 else None, [0, 0.01, 0.1, 1, 10, 100]
    if stat == "cos_sim":
        low = min(min(finite, default=1.0), thresholds.min_cos_sim, 0.9)
        ticks = [t for t in (0.0, 0.5, 0.9, 0.99, 0.999, 0.9999) if t >= low]
        # 0.9999 is the top: an E4M3 round trip cannot beat about 0.9996, E5M2 about 0.9986
        return FuncNorm((_cos_forward, _cos_inverse), vmin=low, vmax=0.9999), thresholds.min_cos_sim, ticks
    if spec(stat).log:
        positive = [v for v in finite if v > 0] or [1.0]
        low, high = min(positive), max(positive)
        return LogNorm(low if low < high else low / 10, high if low < high else high * 10), None, None
    low, top = min(min(finite, default=0.0), 0.0), max(finite, default=0.0)
    return Normalize(low, top if top > low else low + 1.0), None, None


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)  # Agg, without pyplot's global state
    return fig


#: Cells not logged, or cast with delayed scaling's initial scale 1 (not coloured as data).
NOT_LOGGED = "#d0d0d0"
NOT_LOGGED_NOTE = "grey: not logged, or cast with the initial scale 1"
#: Cells logged as NaN: the statistic of a tensor that held NaN/Inf. Grey, as not logged, made a
#: diverged run's heatmaps read as if fp8_stats had stopped logging at the divergence.
NAN_CELL = "#1f4e9c"
NAN_NOTE = "blue: logged as NaN (the tensor held NaN/Inf: see nan_count)"
#: Cells of a layer that ran in high precision (`RunMetrics.high_precision`: not converted to FP8,
#: or fp8_guard's fallback): what-if numbers, coloured as such but hatched, so they never read as
#: the layer's FP8 casts.
HIGH_PRECISION_NOTE = ("hatched: fp8_guard ran the layer in high precision, or te_swap did not "
                       "convert it (what-if numbers)")
#: Cells of a tensor its layer's FP8 run does not cast (`RunMetrics.uncast`), hatched alike.
UNCAST_NOTE = "hatched: not cast to FP8 (NVTE_BACKWARD_OVERRIDE's dY; what-if numbers)"


@dataclass(frozen=True)
class Panel:
    """One tensor kind's layers x steps matrix (NaN: grey) and its colour scale."""

    tensor: str
    title: str
    matrix: Any  # float64 [layers, steps]
    norm: Any  # a matplotlib.colors.Normalize
    limit: float | None  # the threshold, marked on the colour bar
    ticks: list[float] | None  # the colour bar's ticks (None: the norm's own)
    high_precision: Any  # bool [layers, steps]: what-if numbers (fp8_guard's, or no cast)
    nan: Any  # bool [layers, steps]: logged as NaN (`NAN_CELL`), not a missing cell

    def hatched_runs(self) -> list[tuple[int, int, int]]:
        """(row, first column, columns) of each run of hatched cells along a row."""
        return cell_runs(self.high_precision)

    def nan_runs(self) -> list[tuple[int, int, int]]:
        """(row, first column, columns) of each run of cells logged as NaN along a row."""
        return cell_runs(self.nan)


def cell_runs(mask: Any) -> list[tuple[int, int, int]]:
    """(row, first column, columns) of each run of True cells along a row of `mask`."""
    runs = []
    for row, cells in enumerate(mask.tolist()):
        col = 0
        while col < len(cells):
            if cells[col]:
                end = col
                while end < len(cells) and cells[end]:
                    end += 1
                runs.append((row, col, end - col))
                col = end
            else:
                col += 1
    return runs


@dataclass(frozen=True)
class Heatmap:
    """What a heatmap shows, before any drawing: the report's matplotlib figure and the raster
    images `fp8_stats` logs (`health.raster`) both draw from it."""

    stat: str
    prefix: str  # the layers' common prefix, left off `names`
    names: list[str]  # layer labels, one line each, bounded and distinct (`short_names`)
    steps: list[int]
    panels: list[Panel]
    cmap: Any  # NaN cells (masked) get NOT_LOGGED
    annotate: bool  # the numbers fit into the cells
    worse: str | None
    left_out: int = 0  # tensor kinds beyond MAX_PANELS, not drawn
    hatch_notes: tuple[str, ...] = ()  # what the hatched cells are (none: no cell hatched)
    nan_cells: bool = False  # some cell was logged as NaN (NAN_NOTE)
    per_column: int = 1  # logging steps a column shows (`bin_columns`); `steps`: each one's first
    per_row: int = 1  # layers a row shows; `names`: each one's first

    @property
    def shared_scale(self) -> bool:
        return spec(self.stat).shared_scale

    @property
    def title(self) -> str:
        layers = f"layers under {bounded(self.prefix)}" if self.prefix else "layers"
        more = (f" (the first {len(self.panels)} of {len(self.panels) + self.left_out} tensor "
                "kinds)" if self.left_out else "")
        return f"{bounded(self.stat)}: {layers} × logging steps{more}"

    @property
    def label(self) -> str:
        """What the colour scale shows, with units."""
        return bounded(spec(self.stat).label)

    @property
    def notes(self) -> str:
        """What the grey and (where any) the NaN and hatched cells are."""
        binned = (f"each column: the worst of up to {self.per_column} logging steps from the "
                  "step it is labelled with (blue or hatched where any of them is)",
                  ) if self.per_column > 1 else ()
        binned += (f"each row: the worst of up to {self.per_row} layers from the one it is "
                   "labelled with",) if self.per_row > 1 else ()
        return "; ".join((*binned, NOT_LOGGED_NOTE, *((NAN_NOTE,) if self.nan_cells else ()),
                          *self.hatch_notes))

    @property
    def threshold_note(self) -> str:
        """What the colour bar's black line marks ("" when there is no threshold)."""
        limit = self.panels[-1].limit
        return f"black line: flagged beyond {limit:g}" if limit else ""

    def cell_text(self, value: float) -> str:
        """A number that fits a cell; cosines (within -1 to 1) need their digits after the 0.99."""
        return f"{value:.5f}" if self.stat == "cos_sim" and abs(value) <= 1 else f"{value:.2g}"

    def dark(self, level: float) -> bool:
        """Whether a cell at this colour level (0-1) is dark enough for white text."""
        return level < 0.35 if self.worse == "low" else level > 0.65


#: Columns the report's heatmap panel draws at most: a panel is at most 4.8 inches (about 400
#: pixels of axes at 110 dpi), and a matrix wider than its pixels is sampled, not reduced, so a
#: one-step overflow burst or NaN among 20k logging steps (`interval: 1`) would not show. Wider
#: runs are binned (`bin_columns`): each column the worst of its steps.
MAX_COLUMNS = 200
#: Rows likewise: a panel is at most about 2,400 pixels high, and a model watched in more layers
#: (an MoE's experts) gets each row the worst of several consecutive layers.
MAX_ROWS = 1000


def heatmap(run: RunMetrics, stat: str, thresholds: Thresholds,
            formats: Formats | None = None, max_columns: int | None = None,
            max_rows: int | None = None) -> Heatmap:
    """One panel per tensor kind that logged `stat`: layers down, logging steps across, titled
    with the formats its rows were cast in (`formats`; none where not given); more logging steps
    than `max_columns`, and more layers than `max_rows`, are binned (`bin_columns`)."""
    import matplotlib
    import numpy as np

    sp = spec(stat)
    logged = [t for t in run.tensors if any((layer, t, stat) in run.values for layer in run.layers)]
    tensors = logged[:MAX_PANELS]
    kinds = short_names(tensors)
    prefix = common_prefix(run.layers)
    per_column = (math.ceil(len(run.steps) / max_columns)
                  if max_columns is not None and len(run.steps) > max_columns else 1)
    per_row = (math.ceil(len(run.layers) / max_rows)
               if max_rows is not None and len(run.layers) > max_rows else 1)
    column = {step: i for i, step in enumerate(run.steps)}
    row = {layer: i for i, layer in enumerate(run.layers)}
    shape = (len(run.layers), len(run.steps))

    def cells(marked: set[tuple[str, str, int]], tensor: str) -> Any:
        """The bool [layers, steps] of `marked`'s cells of `tensor` (each mark looked at once)."""
        mask = np.zeros(shape, dtype=bool)
        for layer, t, step in marked:
            if t == tensor and layer in row and step in column:
                mask[row[layer], column[step]] = True
        return mask

    matrices = {}
    for tensor in tensors:
        nan = np.zeros(shape, dtype=bool)
        for layer in run.layers:
            for step, value in run.values.get((layer, tensor, stat), {}).items():
                if math.isnan(value) and (layer, tensor, step) not in run.initial:
                    nan[row[layer], column[step]] = True
        hatched = (cells(run.high_precision, tensor), cells(run.uncast, tensor))
        matrix = drawable(np.array(heatmap_matrix(run, stat, tensor), dtype=float))
        binned = bin_columns(stat, matrix, nan, *hatched, per_column=per_column)
        matrices[tensor] = tuple(a.T for a in bin_columns(stat, *(a.T for a in binned),
                                                          per_column=per_row))
    shared = [v for m, *_ in matrices.values() for v in m.ravel().tolist()]
    cmap = matplotlib.colormaps["YlOrRd_r" if sp.worse == "low" else "YlOrRd"].with_extremes(
        bad=NOT_LOGGED)
    panels = []
    notes = {HIGH_PRECISION_NOTE: False, UNCAST_NOTE: False}
    for tensor in tensors:
        matrix, nan, fallen, uncast = matrices[tensor]
        norm, limit, ticks = _norm(stat, shared if sp.shared_scale else matrix.ravel().tolist(), thresholds)
        if sp.log:  # a zero error is the best colour, not a hole
            matrix = np.where(matrix <= 0, norm.vmin, matrix)
        finite = matrix[np.isfinite(matrix)]
        quiet = " - all 0" if finite.size and not finite.any() else ""
        title = panel_title(kinds[tensor], (formats or {}).get(tensor))
        notes[HIGH_PRECISION_NOTE] |= bool(fallen.any())
        notes[UNCAST_NOTE] |= bool(uncast.any())
        panels.append(Panel(tensor, f"{title}{quiet}", matrix, norm, limit, ticks,
                            fallen | uncast, nan))
    labels = short_names(run.layers, prefix)
    names = [labels[layer] for layer in run.layers[::per_row]]
    annotate = len(run.steps) <= 12 and len(names) <= 40 and not sp.log
    return Heatmap(stat, prefix, names, run.steps[::per_column], panels, cmap, annotate,
                   sp.worse, len(logged) - len(tensors),
                   tuple(note for note, on in notes.items() if on),
                   any(bool(p.nan.any()) for p in panels), per_column, per_row)


def bin_columns(stat: str, matrix: Any, *masks: Any, per_column: int = 1) -> tuple[Any, ...]:
    """`matrix` (NaN: no value) and its bool `masks` with every `per_column` adjacent columns
    made one: the value worst by `specs.badness` (NaN where the column has none), each mask
    True where any of its cells is. 1: unchanged."""
    import numpy as np

    if per_column == 1:
        return (matrix, *masks)
    rows, width = matrix.shape
    columns = math.ceil(width / per_column)
    pad = columns * per_column - width

    def grouped(a: Any, fill: Any) -> Any:
        return np.pad(a, ((0, 0), (0, pad)), constant_values=fill).reshape(rows, columns, per_column)

    values = grouped(matrix, np.nan)
    worse = spec(stat).worse
    with np.errstate(divide="ignore", invalid="ignore"):
        bad = (-values if worse == "low" else
               np.where(values > 0, np.abs(np.log(values)), np.inf) if worse == "far_from_1" else
               values)
    bad = np.where(np.isnan(values), -np.inf, bad)
    worst = np.take_along_axis(values, bad.argmax(axis=2)[..., None], axis=2)[..., 0]
    return (worst, *(grouped(m, False).any(axis=2) for m in masks))


#: Inches a character of a cell's number takes at its 6-point size (DejaVu Sans digits are
#: 0.64 em wide: 3.8 points).
CELL_DIGIT_IN = 0.055


#: Inches an 8-point character of the colour bar's label takes along the bar (DejaVu Sans
#: averages about 0.6 em), and the inches of the figure's height the bar does not span (titles,
#: step ticks and label).
BAR_CHAR_IN = 0.068
BAR_MARGIN_IN = 1.3


def draw_heatmap(run: RunMetrics, stat: str, thresholds: Thresholds,
                 formats: Formats | None = None) -> Any:
    """The report's heatmap (`heatmap`) as a matplotlib figure."""
    import numpy as np
    from matplotlib.patches import Rectangle

    hm = heatmap(run, stat, thresholds, formats, MAX_COLUMNS, MAX_ROWS)
    names = [text(name) for name in hm.names]
    n_layers, n_steps = len(names), len(hm.steps)
    height = min(max(2.6, 0.26 * n_layers + 1.5), 24.0)
    panel = min(max(2.2, 0.17 * n_steps + 1.3), 4.8)
    if hm.annotate:  # the numbers written in the cells fit side by side (cosines: 0.99965)
        widest = max((len(hm.cell_text(v)) for p in hm.panels for v in p.matrix.ravel().tolist()
                      if math.isfinite(v)), default=0)
        panel = max(panel, n_steps * (CELL_DIGIT_IN * widest + 0.08) + 0.3)
    bars = 1 if hm.shared_scale else len(hm.panels)  # colour bars, about 0.9 inch each
    width = 0.065 * max(map(len, names)) + 0.4 + panel * len(hm.panels) + 0.9 * bars
    fig = _figure(width, height)
    axes = fig.subplots(1, len(hm.panels), sharey=True, squeeze=False)[0]
    for ax, p in zip(axes, hm.panels, strict=True):
        image = ax.imshow(np.ma.masked_invalid(p.matrix), aspect="auto", interpolation="nearest",
                          cmap=hm.cmap, norm=p.norm)
        ax.set_title(text(p.title), fontsize=9)
        for row, col, n in p.nan_runs():
            ax.add_patch(Rectangle((col - 0.5, row - 0.5), n, 1, color=NAN_CELL, lw=0))
        for row, col, n in p.hatched_runs():
            ax.add_patch(Rectangle((col - 0.5, row - 0.5), n, 1, fill=False, hatch="//",
                                   edgecolor="0.3", lw=0.8))
        xticks = tick_indices(n_steps, int(panel * 2.5))
        ax.set_xticks(xticks, [str(hm.steps[i]) for i in xticks], fontsize=7,
                      rotation=90 if len(str(hm.steps[-1])) > 3 else 0)
        ax.set_xlabel("step", fontsize=8)
        if hm.annotate:
            for (row, col), value in np.ndenumerate(p.matrix):
                if math.isfinite(value):
                    ax.text(col, row, hm.cell_text(value), ha="center", va="center", fontsize=6,
                            color="white" if hm.dark(float(p.norm(value))) else "black")
        if not hm.shared_scale or ax is axes[-1]:
            bar = fig.colorbar(image, ax=ax if not hm.shared_scale else list(axes), shrink=0.95,
                               aspect=30, pad=0.02)
            if ax is axes[-1]:
                note = hm.threshold_note
                # wrapped to the bar's height: a figure of 1-2 layers is 2.6 inches tall, and
                # the underflow label with its note ran past the top, cut off
                fit = max(16, int((height - BAR_MARGIN_IN) / BAR_CHAR_IN))
                bar.set_label("\n".join(textwrap.wrap(hm.label, fit) + (
                    textwrap.wrap(f"({note})", fit) if note else [])), fontsize=8)
            if p.ticks is not None:
                bar.set_ticks(p.ticks, labels=[f"{t:g}" for t in p.ticks])
            _readable_log_ticks(bar.ax, p.norm.vmin, p.norm.vmax)
            if p.limit is not None:
                bar.ax.axhline(p.limit, color="black", lw=1.5)
    yticks = tick_indices(n_layers, int((height - 1.5) / 0.13))
    axes[0].set_yticks(yticks, [names[i] for i in yticks], fontsize=7)
    fig.suptitle(text(hm.title) + "\n" + text(f"({hm.notes})"), fontsize=10)
    return fig


#: Decades a log y axis spans above which it gets no minor ticks: unlabelled there (matplotlib
#: labels them below two decades), they only grid 8 lines a decade, and a diverged run's panels
#: (5 to 8 decades) held 700 of the time series' 840 ticks, each laid out twice by the
#: constrained layout: half the report's time.
MINOR_TICK_DECADES = 4


def plain_labels(values: list[float], digits: int = 3) -> list[str]:
    """Plain numbers (`0.7`, `6`, `2000`) with at least `digits` significant digits and as many
    more as keep the labels apart: a healthy delayed-scaling run's scale_ratio stays within
    1.000 to 1.010, and 3 digits labelled each of its ticks `1`."""
    import numpy as np

    def plain(v: float, n: int) -> str:
        if not 1e-4 <= v < 1e5:
            return f"{v:.{n - 1}g}"
        return np.format_float_positional(v, precision=n, fractional=False, trim="-")

    labels: list[str] = []
    for n in range(digits, 18):  # 17 significant digits tell every two float64 apart
        labels = [plain(v, n) for v in values]
        if len(set(labels)) == len(labels):
            break
    return labels


def _readable_log_ticks(ax: Any, low: float | None = None, high: float | None = None) -> None:
    """Plain numbers (`plain_labels`) on a log y axis (or colour bar: pass its norm's range,
    its limits are 0-1) spanning less than two decades, where
    matplotlib would print `6 x 10^0` at mixed sizes; between one and two decades only the minor
    ticks at 2 and 5 get a label. Beyond MINOR_TICK_DECADES, no minor ticks."""
    from matplotlib.ticker import Formatter, NullLocator

    class Plain(Formatter):
        def __init__(self, two_and_five: bool) -> None:
            self.two_and_five = two_and_five

        def __call__(self, x: float, _pos: int | None = None) -> str:
            return self.format_ticks([x])[0]

        def format_ticks(self, values: list[float]) -> list[str]:
            shown = [not self.two_and_five or f"{v:.0e}"[0] in "25" for v in values]
            labels = iter(plain_labels([v for v, on in zip(values, shown, strict=True) if on]))
            return [next(labels) if on else "" for on in shown]

    ax.tick_params(which="both", labelsize=7)
    if low is None or high is None:
        low, high = ax.get_ylim()
    if ax.get_yscale() == "log" and low > 0 and high / low < 100:
        ax.yaxis.set_major_formatter(Plain(two_and_five=False))
        ax.yaxis.set_minor_formatter(Plain(two_and_five=high / low >= 10))
    elif ax.get_yscale() == "log" and low > 0 and high / low > 10 ** MINOR_TICK_DECADES:
        ax.yaxis.set_minor_locator(NullLocator())


#: Points a series line marks one by one; past it the line alone (a marker per logging step of
#: a long run is most of the picture's drawing time, and they merge into a thick line anyway)
#: but for its `isolated` points, which no line segment shows.
MARKED_POINTS = 200


def isolated(values: list[float], log: bool) -> list[int]:
    """The indices of the points a line joins to no neighbour: each neighbour NaN/Inf (or, on a
    log axis, not positive) or absent."""
    shown = [math.isfinite(v) and (v > 0 or not log) for v in values]
    return [i for i, on in enumerate(shown)
            if on and (i == 0 or not shown[i - 1]) and (i + 1 == len(shown) or not shown[i + 1])]
#: Characters a line of a series row's y label holds: a row is 2.1 inches high (`draw_series`),
#: about 34 characters of the labels' 8-point type.
YLABEL_CHARS = 30


def draw_series(run: RunMetrics, chosen: list[tuple[str, str]],
                formats: Formats | None = None) -> Any:
    """Rows: amax, scale (current_scale, scale_ratio when logged); columns: tensor kinds, titled
    as the heatmaps' panels (`formats`)."""
    from matplotlib.ticker import MaxNLocator

    stats = [s for s in run.stats if spec(s).plot == "series"]
    tensors = run.tensors[:MAX_PANELS]
    kinds = short_names(tensors)
    chosen = chosen[:MAX_SERIES_LAYERS]
    labels = short_names(run.layers, common_prefix(run.layers))
    fig = _figure(3.6 * len(tensors) + 0.6, 2.1 * len(stats) + 1.0 + 0.22 * len(chosen))
    axes = fig.subplots(len(stats), len(tensors), sharex=True, squeeze=False)
    for row, stat in enumerate(stats):
        for col, tensor in enumerate(tensors):
            ax = axes[row][col]
            lines = [(steps, drawable(values).tolist()) for steps, values in
                     (series(run, layer, tensor, stat) for layer, _ in chosen)]
            # no log axis without a positive value to place on it (matplotlib warns)
            log = spec(stat).log and any(v > 0 for _, values in lines for v in values)
            for k, ((layer, why), (steps, values)) in enumerate(zip(chosen, lines, strict=True)):
                alone = isolated(values, log) if len(steps) > MARKED_POINTS else None
                ax.plot(steps, values, marker="o" if alone is None or alone else None,
                        markevery=alone or None, ms=2.5, lw=1.2, color=f"C{k % 10}",
                        label=text(labels[layer] + (f" ({why})" if why else "")))
            limits = log_limits(lines) if log else None
            if log:
                ax.set_yscale("log")
            if limits is not None:
                ax.set_ylim(limits[0], limits[1])
                ax.text(0.98, 0.03, f"step {limits[2]} off scale", transform=ax.transAxes,
                        ha="right", fontsize=6, color="dimgrey")
            if stat == "scale_ratio":
                ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            _readable_log_ticks(ax)
            if len(run.steps) <= 12:
                ax.set_xticks(run.steps)
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3, which="both", lw=0.5)
            if row == 0:
                ax.set_title(text(panel_title(kinds[tensor], (formats or {}).get(tensor))),
                             fontsize=9)
            if col == 0:  # wrapped to the row's height: one line overran its neighbours
                label = spec(stat).label
                label = label if label.startswith(stat) else f"{stat}: {label}"
                ax.set_ylabel(textwrap.fill(label, YLABEL_CHARS), fontsize=8)
            if row == len(stats) - 1:
                ax.set_xlabel("step", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncols=1, fontsize=8, frameon=False)
    return fig


def save_png(fig: Any, path: Path) -> None:
    fig.savefig(path)
