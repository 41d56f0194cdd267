"""`foundry-fp8 report RUN_FOLDER`: the FP8 health of a run, per layer and tensor.

Reads the run's `metrics.jsonl` (written by the `jsonl` logger; `fp8_stats` logs
`fp8/<layer>/<tensor>/<stat>`) and writes, into the run folder or `--out`:

- `fp8_heatmap_<stat>.png`: layers × logging steps, one panel per tensor kind, for
  underflow_pct, overflow_pct, mse, cos_sim (NaN/Inf counts when any were seen, and any
  statistic this version does not know);
- `fp8_timeseries.png`: amax and scale (current_scale and scale_ratio when logged) over the steps
  for a few layers: `--layers REGEX`, or the first and last block and the layer with the most
  underflow;
- `fp8_report.md`: flagged layers, the worst layers per statistic, a reading guide, the plots,
  and the worst value of every statistic per layer and tensor.

Flags follow what `fp8_stats` warns about, with the run's own thresholds (from hparams.json):
underflow_pct, overflow_pct and cos_sim, plus any NaN/Inf. `scale_ratio` is shown (time series,
worst layers, table) but not flagged: a delayed scale the tensor outgrew saturates elements,
and overflow_pct already judges how many, with a threshold that tolerates the few a slowly
growing amax saturates by design.

A run killed mid-write leaves a partial line in metrics.jsonl (see `read_jsonl`): such lines are
skipped with one warning, and the report covers the rest.

Everything up to the drawing is pure Python on plain data (tested exactly); the drawing is a thin
matplotlib layer, imported only when drawing. No torch.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from foundry_fp8.health.thresholds import Thresholds
from foundry_fp8.jsonl import JsonlError, read_jsonl

NAN = float("nan")


@dataclass(frozen=True)
class StatSpec:
    """How one statistic is ranked, drawn and explained."""

    label: str  # colour-bar / axis label, with units
    worse: Literal["high", "low", "far_from_1"] | None  # None: not ranked (e.g. scale)
    plot: Literal["heatmap", "series"] | None
    log: bool = False  # log colour / y scale
    shared_scale: bool = True  # one colour scale for all tensor kinds (comparable numbers)
    listed: bool = True  # worth a "worst layers" entry (mse and amax are not comparable across layers)
    quiet_when_zero: bool = False  # drawn and tabled only when some value is non-zero


#: Logged as 1 by fp8_stats for a tensor cast with delayed scaling's initial scale 1.0.
INITIAL_SCALE = "initial_scale"

SPECS: dict[str, StatSpec] = {
    "underflow_pct": StatSpec("% of elements flushed to 0", "high", "heatmap"),
    "overflow_pct": StatSpec("% of elements above the FP8 max", "high", "heatmap"),
    "mse": StatSpec("MSE of the FP8 round trip (tensor units², log)", "high", "heatmap", log=True,
                    shared_scale=False, listed=False),
    "cos_sim": StatSpec("cosine similarity with the FP8 round trip", "low", "heatmap"),
    "nan_count": StatSpec("NaN elements", "high", "heatmap", quiet_when_zero=True),
    "inf_count": StatSpec("Inf elements", "high", "heatmap", quiet_when_zero=True),
    "amax": StatSpec("amax = max |x|", "high", "series", log=True, listed=False),
    "amin": StatSpec("smallest non-zero |x|", None, None, log=True),
    "scale": StatSpec("scale (x is multiplied by it before the cast)", None, "series", log=True),
    "current_scale": StatSpec("current_scale = FP8 max / amax", None, "series", log=True),
    "scale_ratio": StatSpec("scale_ratio = delayed / current scale", "far_from_1", "series", log=True),
}
# The markdown table's fixed columns (its layout predates the plots); ranked extras follow.
WORST = ("underflow_pct", "overflow_pct", "mse", "cos_sim", "amax")
TENSOR_ORDER = ("activation", "weight", "gradient")
TENSOR_FORMAT = {"activation": "E4M3", "weight": "E4M3", "gradient": "E5M2"}
SERIES_FILE = "fp8_timeseries.png"
MAX_PRINTED = 10  # flagged rows on the terminal; the markdown has them all


def spec(stat: str) -> StatSpec:
    """A statistic this version does not know still gets a heatmap, larger taken as worse."""
    return SPECS.get(stat, StatSpec(stat, "high", "heatmap"))


def badness(stat: str, value: float) -> float:
    """A number that grows as `value` gets worse, so one `max` ranks every statistic."""
    worse = spec(stat).worse
    if worse == "low":
        return -value
    if worse == "far_from_1":
        return abs(math.log(value)) if value > 0 else math.inf
    return value


def thresholds_from_hparams(hparams: Mapping[str, Any]) -> Thresholds:
    """The run's own `fp8_stats` thresholds (from the `jsonl` logger's hparams.json), so the
    report flags what the run warned about."""
    callbacks = hparams.get("callbacks")
    cfg = callbacks.get("fp8_stats") if isinstance(callbacks, Mapping) else None
    if not isinstance(cfg, Mapping):
        return Thresholds()
    keys = ("max_underflow_pct", "max_overflow_pct", "min_cos_sim")
    given = {k: float(cfg[k]) for k in keys
             if isinstance(cfg.get(k), (int, float)) and not isinstance(cfg[k], bool)}
    return Thresholds(**given, source="the run's fp8_stats settings (hparams.json)")


@dataclass
class RunMetrics:
    """The `fp8/` metrics of one run: `values[(layer, tensor, stat)][step]`."""

    values: dict[tuple[str, str, str], dict[int, float]] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)  # first-logged order = forward order
    tensors: list[str] = field(default_factory=list)
    stats: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # every step with any fp8 metric, sorted
    # (layer, tensor, step) cast with delayed scaling's initial scale 1.0 (fp8_stats logs
    # `initial_scale`): plotted, but neither flagged nor ranked, as fp8_stats does not warn
    initial: set[tuple[str, str, int]] = field(default_factory=set)

    def judged(self, layer: str, tensor: str, by_step: dict[int, float]) -> dict[int, float]:
        """`by_step` without the steps cast with the initial scale."""
        return {step: v for step, v in by_step.items() if (layer, tensor, step) not in self.initial}


def known_first(names: Iterable[str], known: Iterable[str]) -> list[str]:
    """`names` in the order of `known`, unknown ones after them in their own order."""
    order = {name: i for i, name in enumerate(known)}
    return sorted(names, key=lambda name: order.get(name, len(order)))


def collect(records: Iterable[tuple[int, Mapping[str, Any]]]) -> RunMetrics:
    """Gather `fp8/<layer>/<tensor>/<stat>` numbers; a step logged twice (a resumed run appending
    to the same file) keeps its later value."""
    values: dict[tuple[str, str, str], dict[int, float]] = {}
    layers: dict[str, None] = {}  # dicts as ordered sets
    tensors: dict[str, None] = {}
    stats: dict[str, None] = {}
    steps: set[int] = set()
    initial: set[tuple[str, str, int]] = set()
    for step, metrics in records:
        for name, value in metrics.items():
            parts = name.split("/")
            if (len(parts) != 4 or parts[0] != "fp8" or isinstance(value, bool)
                    or not isinstance(value, (int, float))):
                continue
            _, layer, tensor, stat = parts
            if stat == INITIAL_SCALE:
                if value:
                    initial.add((layer, tensor, step))
                continue
            values.setdefault((layer, tensor, stat), {})[step] = float(value)
            layers.setdefault(layer)
            tensors.setdefault(tensor)
            stats.setdefault(stat)
            steps.add(step)
    return RunMetrics(values=values, layers=list(layers), tensors=known_first(tensors, TENSOR_ORDER),
                      stats=known_first(stats, SPECS), steps=sorted(steps), initial=initial)


def load(metrics_file: Path, skipped: list[int] | None = None) -> RunMetrics:
    """The run's metrics; numbers of undecodable lines (a killed run's) go to `skipped`."""
    return collect(read_jsonl(metrics_file, skipped))


def heatmap_matrix(run: RunMetrics, stat: str, tensor: str) -> list[list[float]]:
    """Rows `run.layers`, columns `run.steps`; NaN where that layer and tensor was not logged."""
    return [[run.values.get((layer, tensor, stat), {}).get(step, NAN) for step in run.steps]
            for layer in run.layers]


def series(run: RunMetrics, layer: str, tensor: str, stat: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one layer's statistic, in step order."""
    by_step = run.values.get((layer, tensor, stat), {})
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def worst_point(stat: str, by_step: Mapping[int, float]) -> tuple[int, float] | None:
    """(step, value) of the worst finite value; NaN never hides a real bad value."""
    finite = [(s, v) for s, v in by_step.items() if v == v]
    return max(finite, key=lambda sv: badness(stat, sv[1])) if finite else None


def worst_values(run: RunMetrics) -> dict[tuple[str, str], dict[str, float]]:
    """(layer, tensor) -> worst value of each ranked statistic over the logged steps (not those
    cast with the initial delayed scale)."""
    table: dict[tuple[str, str], dict[str, float]] = {}
    for (layer, tensor, stat), logged in run.values.items():
        by_step = run.judged(layer, tensor, logged)
        point = worst_point(stat, by_step) if spec(stat).worse else None
        if point is not None:
            table.setdefault((layer, tensor), {})[stat] = point[1]
    return table


def worst_stats(metrics_file: Path) -> dict[tuple[str, str], dict[str, float]]:
    """(layer, tensor) -> worst value of each ranked statistic in the file."""
    return worst_values(load(metrics_file))


def all_zero(run: RunMetrics, stat: str) -> bool:
    return all(v == 0 for (_, _, s), by_step in run.values.items() if s == stat
               for v in by_step.values())


def shown(run: RunMetrics, stat: str) -> bool:
    """Whether a statistic earns a plot (NaN/Inf counts only when some were seen)."""
    return stat in run.stats and not (spec(stat).quiet_when_zero and all_zero(run, stat))


@dataclass(frozen=True)
class Finding:
    layer: str
    tensor: str
    stat: str
    value: float
    step: int
    limit: str = ""  # the rule it breaks, e.g. "> 5 %"
    steps_over: int = 0  # logged steps that break it ...
    steps_logged: int = 0  # ... of these (one bad step 0 reads differently from all of them)


def findings(run: RunMetrics, thresholds: Thresholds) -> list[Finding]:
    """Every (layer, tensor, statistic) whose worst value breaks a threshold; the ones bad on
    most of their steps first (persistent problems are the actionable ones).

    The rules are fp8_stats's warnings (underflow, overflow, cos_sim) plus any NaN/Inf; not
    scale_ratio, which fp8_stats does not warn about either (see the module doc)."""
    rules = {
        "nan_count": (lambda v: v > 0, "> 0"),
        "inf_count": (lambda v: v > 0, "> 0"),
        "overflow_pct": (lambda v: v > thresholds.max_overflow_pct, f"> {thresholds.max_overflow_pct:g} %"),
        "underflow_pct": (lambda v: v > thresholds.max_underflow_pct, f"> {thresholds.max_underflow_pct:g} %"),
        "cos_sim": (lambda v: v < thresholds.min_cos_sim, f"< {thresholds.min_cos_sim:g}"),
    }
    found = []
    for (layer, tensor, stat), logged in run.values.items():
        by_step = run.judged(layer, tensor, logged)
        point = worst_point(stat, by_step) if stat in rules and by_step else None
        if point is not None and rules[stat][0](point[1]):
            over = sum(1 for v in by_step.values() if rules[stat][0](v))
            found.append(Finding(layer, tensor, stat, point[1], point[0], rules[stat][1],
                                 over, len(by_step)))
    order = list(rules)
    return sorted(found, key=lambda f: (-f.steps_over / f.steps_logged, order.index(f.stat),
                                        -badness(f.stat, f.value)))


@dataclass(frozen=True)
class Ranked:
    layer: str
    tensor: str
    mean: float  # over the logged steps: the typical state
    worst: float
    step: int  # where the worst was


def worst_layers(run: RunMetrics, stat: str, n: int = 3) -> list[Ranked]:
    """The `n` (layer, tensor) pairs with the worst mean of `stat`, leaving out perfect ones (no
    underflow anywhere is not a ranking). The mean, not the peak: under delayed scaling every
    layer's step 0 runs on the initial scale 1.0 and underflows, which would rank at random."""
    ranked = []
    for (layer, tensor, s), logged in run.values.items():
        by_step = run.judged(layer, tensor, logged)
        point = worst_point(stat, by_step) if s == stat and by_step else None
        if point is not None:
            mean = statistics.fmean(v for v in by_step.values() if v == v)
            ranked.append(Ranked(layer, tensor, mean, point[1], point[0]))
    ranked.sort(key=lambda r: -badness(stat, r.mean))
    perfect = {"high": 0.0, "low": 1.0, "far_from_1": 1.0}.get(spec(stat).worse or "", NAN)
    return [r for r in ranked[:n] if r.mean != perfect]


def block_index(layer: str) -> int | None:
    """The first numeric component of a module name (`...blocks.7.attn` -> 7), if any."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", layer)
    return int(match.group(1)) if match else None


def choose_layers(run: RunMetrics, pattern: str | None = None) -> list[tuple[str, str]]:
    """(layer, why) for the time-series plot, in model order: the layers matching `pattern`
    (why: ""), or else the first layer of the first block, the last layer of the last block and
    the layer with the worst underflow."""
    if pattern is not None:
        return [(layer, "") for layer in run.layers if re.search(pattern, layer)]
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


# ---- drawing: thin matplotlib over the functions above ----------------------------------

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


def _cell(stat: str, value: float) -> str:
    """A number that fits a heatmap cell; cosines need their digits after the 0.99."""
    return f"{value:.5f}" if stat == "cos_sim" else f"{value:.2g}"


def draw_heatmap(run: RunMetrics, stat: str, path: Path, thresholds: Thresholds) -> None:
    """One panel per tensor kind: layers down, logging steps across, grey where not logged."""
    import matplotlib
    import numpy as np

    sp = spec(stat)
    tensors = [t for t in run.tensors if any((layer, t, stat) in run.values for layer in run.layers)]
    prefix = common_prefix(run.layers)
    names = [layer.removeprefix(prefix) for layer in run.layers]
    n_layers, n_steps = len(names), len(run.steps)
    height = min(max(2.6, 0.26 * n_layers + 1.5), 24.0)
    panel = min(max(2.2, 0.17 * n_steps + 1.3), 4.8)
    bars = 1 if sp.shared_scale else len(tensors)  # colour bars, about 0.9 inch each
    width = 0.065 * max(map(len, names)) + 0.4 + panel * len(tensors) + 0.9 * bars
    fig = _figure(width, height)
    axes = fig.subplots(1, len(tensors), sharey=True, squeeze=False)[0]
    matrices = {t: np.array(heatmap_matrix(run, stat, t), dtype=float) for t in tensors}
    shared = [v for m in matrices.values() for v in m.ravel().tolist()]
    cmap = matplotlib.colormaps["YlOrRd_r" if sp.worse == "low" else "YlOrRd"].with_extremes(bad="#d0d0d0")
    annotate = n_steps <= 12 and n_layers <= 40 and not sp.log  # numbers in cells when they fit
    for ax, tensor in zip(axes, tensors, strict=True):
        matrix = matrices[tensor]
        norm, limit, ticks = _norm(stat, shared if sp.shared_scale else matrix.ravel().tolist(), thresholds)
        if sp.log:  # a zero error is the best colour, not a hole
            matrix = np.where(matrix <= 0, norm.vmin, matrix)
        image = ax.imshow(np.ma.masked_invalid(matrix), aspect="auto", interpolation="nearest",
                          cmap=cmap, norm=norm)
        finite = matrix[np.isfinite(matrix)]
        quiet = " - all 0" if finite.size and not finite.any() else ""
        ax.set_title(f"{tensor} ({TENSOR_FORMAT.get(tensor, '?')}){quiet}", fontsize=9)
        xticks = tick_indices(n_steps, int(panel * 2.5))
        ax.set_xticks(xticks, [str(run.steps[i]) for i in xticks], fontsize=7,
                      rotation=90 if len(str(run.steps[-1])) > 3 else 0)
        ax.set_xlabel("step", fontsize=8)
        if annotate:
            for (row, col), value in np.ndenumerate(matrix):
                if math.isfinite(value):
                    level = float(norm(value))
                    dark = level < 0.35 if sp.worse == "low" else level > 0.65
                    ax.text(col, row, _cell(stat, value), ha="center", va="center", fontsize=6,
                            color="white" if dark else "black")
        if not sp.shared_scale or ax is axes[-1]:
            bar = fig.colorbar(image, ax=ax if not sp.shared_scale else list(axes), shrink=0.95,
                               aspect=30, pad=0.02)
            if ax is axes[-1]:
                bar.set_label(sp.label + (f"\n(black line: flagged beyond {limit:g})" if limit else ""),
                              fontsize=8)
            if ticks is not None:
                bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
            _readable_log_ticks(bar.ax, norm.vmin, norm.vmax)
            if limit is not None:
                bar.ax.axhline(limit, color="black", lw=1.5)
    yticks = tick_indices(n_layers, int((height - 1.5) / 0.13))
    axes[0].set_yticks(yticks, [names[i] for i in yticks], fontsize=7)
    where = f"layers under {prefix}" if prefix else "layers"
    fig.suptitle(f"{stat}: {where} × logging steps (grey: not logged)", fontsize=10)
    fig.savefig(path)


def _readable_log_ticks(ax: Any, low: float | None = None, high: float | None = None) -> None:
    """Plain numbers (`0.7`, `6`, `2000`) on a log y axis (or colour bar: pass its norm's range,
    its limits are 0-1) spanning less than two decades, where
    matplotlib would print `6 x 10^0` at mixed sizes; between one and two decades only the minor
    ticks at 2 and 5 get a label."""
    import numpy as np
    from matplotlib.ticker import FuncFormatter

    def plain(v: float, _: Any = None) -> str:
        if not 1e-4 <= v < 1e5:
            return f"{v:.2g}"
        return np.format_float_positional(v, precision=3, fractional=False, trim="-")

    def two_and_five(v: float, _: Any = None) -> str:
        return plain(v) if f"{v:.0e}"[0] in "25" else ""

    ax.tick_params(which="both", labelsize=7)
    if low is None or high is None:
        low, high = ax.get_ylim()
    if ax.get_yscale() == "log" and low > 0 and high / low < 100:
        ax.yaxis.set_major_formatter(FuncFormatter(plain))
        ax.yaxis.set_minor_formatter(FuncFormatter(plain if high / low < 10 else two_and_five))


def draw_series(run: RunMetrics, chosen: list[tuple[str, str]], path: Path) -> None:
    """Rows: amax, scale (current_scale, scale_ratio when logged); columns: tensor kinds."""
    from matplotlib.ticker import MaxNLocator

    stats = [s for s in run.stats if spec(s).plot == "series"]
    prefix = common_prefix(run.layers)
    fig = _figure(3.6 * len(run.tensors) + 0.6, 2.1 * len(stats) + 1.0 + 0.22 * len(chosen))
    axes = fig.subplots(len(stats), len(run.tensors), sharex=True, squeeze=False)
    for row, stat in enumerate(stats):
        for col, tensor in enumerate(run.tensors):
            ax = axes[row][col]
            lines = [series(run, layer, tensor, stat) for layer, _ in chosen]
            for k, ((layer, why), (steps, values)) in enumerate(zip(chosen, lines, strict=True)):
                ax.plot(steps, values, marker="o", ms=2.5, lw=1.2, color=f"C{k % 10}",
                        label=layer.removeprefix(prefix) + (f" ({why})" if why else ""))
            limits = log_limits(lines) if spec(stat).log else None
            if spec(stat).log:
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
                ax.set_title(f"{tensor} ({TENSOR_FORMAT.get(tensor, '?')})", fontsize=9)
            if col == 0:
                label = spec(stat).label
                ax.set_ylabel(label if label.startswith(stat) else f"{stat}\n{label}", fontsize=8)
            if row == len(stats) - 1:
                ax.set_xlabel("step", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncols=1, fontsize=8, frameon=False)
    fig.savefig(path)


# ---- markdown and command line -----------------------------------------------------------

def render(table: dict[tuple[str, str], dict[str, float]]) -> str:
    """The worst value of each statistic per layer and tensor, worst underflow first."""
    extra = known_first({s: None for row in table.values() for s in row if s not in WORST}, SPECS)
    extra = [s for s in extra if not (spec(s).quiet_when_zero
                                      and all(row.get(s, 0) == 0 for row in table.values()))]
    columns = [*(k for k in WORST if any(k in row for row in table.values())), *extra]
    lines = ["| layer | tensor | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 2)]
    for (layer, tensor), row in sorted(table.items(), key=lambda kv: -kv[1].get("underflow_pct", 0)):
        values = " | ".join(f"{row.get(k, NAN):.4g}" for k in columns)
        lines.append(f"| {layer} | {tensor} | {values} |")
    return "\n".join(lines) + "\n"


GUIDE = """\
- **underflow_pct**: share of elements that are non-zero in high precision and 0 after the FP8
  cast. Under 0.1 % is harmless. Above {underflow:g} % (or a steady climb) that layer loses
  information: keep it in BF16 (`te_swap: exclude`, or `keep_first_blocks`/`keep_last_blocks`
  when it is an edge block) or use current scaling. On gradients (E5M2: more range, less
  precision) it means very small gradients reach that layer.
- **overflow_pct**: share of elements above the FP8 max at the scale in force (they saturate).
  Any non-zero value means the tensor outgrew its delayed scale: use current scaling, a margin
  (`fp8_recipe.margin: 1`), or keep the layer in BF16. Under current scaling it is 0 by
  construction.
- **cos_sim**: cosine similarity of a tensor with its FP8 round trip; healthy E4M3 tensors sit
  near 0.999. Below {cos:g} the FP8 copy points elsewhere: same remedies as underflow.
- **mse**: absolute error of the round trip in the tensor's units²; compare a layer with itself
  over steps and with its neighbours, not across tensor kinds. A jump is the signal.
- **step 0 under delayed scaling** runs on the initial scale 1.0 (no amax history yet), so
  underflow there and a tiny scale_ratio are expected; the "steps over" column tells a one-off
  from a layer that stays bad. Time-series plots leave such a first step off their scale.
- **amax**: largest magnitude. Spikes of 10x or a steady climb come before loss divergence;
  the layer whose amax moves first is where to look.
- **scale_ratio** (when logged; not flagged): delayed scale in force at cast time / current
  scale. About 1: the amax history fits the tensor. Above 1: the tensor outgrew its scale and
  its largest elements saturate; a slowly growing amax does that by design, and overflow_pct
  tells whether it saturates enough to matter. A ratio far above 1 in many layers at once is
  an amax spike: look at amax. Far below 1 (e.g. under 1/16): an old spike in the history
  keeps the scale small and costs precision; a shorter `amax_history_len` or
  `amax_compute_algo: most_recent` helps.
"""


def _fmt(stat: str, value: float) -> str:
    return f"{value:.3g} %" if stat.endswith("_pct") else f"{value:.4g}"


def render_report(run: RunMetrics, found: list[Finding], thresholds: Thresholds,
                  chosen: list[tuple[str, str]], pngs: list[str]) -> str:
    """fp8_report.md: what to look at first, how to read it, the plots, then the full table."""
    prefix = common_prefix(run.layers)
    shape = (f"{len(run.layers)} layers x {len(run.tensors)} tensors ({', '.join(run.tensors)}), "
             f"{len(run.steps)} logging steps ({run.steps[0]} to {run.steps[-1]}); statistics: "
             f"{', '.join(run.stats)}.")
    if prefix:
        shape += f" Plots and lists drop the common prefix `{prefix}`."
    lines = ["# FP8 health report", "", shape, "", "## Flagged", "",
             f"Thresholds from {thresholds.source}: underflow > {thresholds.max_underflow_pct:g} %, "
             f"overflow > {thresholds.max_overflow_pct:g} %, cos_sim < {thresholds.min_cos_sim:g} "
             "(what fp8_stats warns about), and any NaN/Inf. scale_ratio is not flagged: its "
             "cost shows as overflow (above 1) or underflow (far below 1).", ""]
    if found:
        lines += ["| layer | tensor | statistic | worst | at step | rule | steps over |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {f.layer} | {f.tensor} | {f.stat} | {_fmt(f.stat, f.value)} | {f.step} | "
                  f"{f.limit} | {f.steps_over} of {f.steps_logged} |" for f in found]
    else:
        lines.append("No layer crosses a threshold.")
    lines += ["", "## Worst layers (by their mean over the logged steps)", ""]
    for stat in (s for s in run.stats if spec(s).worse and spec(s).listed):
        worst = worst_layers(run, stat)
        entries = "; ".join(f"`{w.layer.removeprefix(prefix)}` {w.tensor} mean {_fmt(stat, w.mean)}, "
                            f"worst {_fmt(stat, w.worst)} (step {w.step})" for w in worst)
        lines.append(f"- **{stat}**: {entries or 'perfect everywhere'}")
    lines += ["", "## How to read this", "",
              GUIDE.format(underflow=thresholds.max_underflow_pct, cos=thresholds.min_cos_sim),
              "## Plots", ""]
    lines += [f"![{png}]({png})" for png in pngs]
    lines += ["", "Time series show " + ", ".join(f"`{layer}`" + (f" ({why})" if why else "")
                                                for layer, why in chosen) + ".",
              "", "## Worst value per layer and tensor", "", render(worst_values(run))]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_folder", type=Path,
                        help="folder holding the run's metrics.jsonl (or the .jsonl file itself)")
    parser.add_argument("--layers", metavar="REGEX",
                        help="layers for the amax/scale time series (re.search on module names); "
                             "default: first and last block and the layer with the most "
                             "underflow (mean over steps)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="where the PNGs and fp8_report.md go (default: the run folder)")


class ReportError(Exception):
    """A one-line reason the report cannot be made (exit 2)."""


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _load_run(metrics_file: Path) -> RunMetrics:
    if not metrics_file.is_file():
        raise ReportError(f"{metrics_file}: not found (was the `jsonl` logger in the YAML?)")
    skipped: list[int] = []
    try:
        if metrics_file.stat().st_size == 0:
            raise ReportError(f"{metrics_file}: empty (did the run log anything?)")
        run = load(metrics_file, skipped)
    except JsonlError as e:
        raise ReportError(str(e)) from None
    except OSError as e:
        raise ReportError(f"{metrics_file}: cannot read ({e.strerror or e})") from None
    if skipped:
        shown_lines = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
        lines = "1 line that does" if len(skipped) == 1 else f"{len(skipped)} lines that do"
        warn(f"{metrics_file}:{skipped[0]}: skipped {lines} not decode (line {shown_lines}; a "
             "run killed mid-write leaves one); the report covers the rest")
    if not run.values:
        raise ReportError(f"{metrics_file}: no fp8/ metrics (was `fp8_stats` in the YAML?)")
    return run


def _out_folder(out: Path) -> None:
    """Create `--out` (or check the run folder) before drawing, so a bad one is one line."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"{out}: not a folder (--out names the folder for the PNGs and "
                          "fp8_report.md)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"{out}: cannot create the output folder ({e.strerror or e})") from None


def _read_hparams(path: Path) -> Thresholds:
    try:
        return thresholds_from_hparams(json.loads(path.read_text()))
    except (OSError, ValueError, AttributeError):
        return Thresholds()


def make_report(run_folder: Path, layers: str | None = None,
                out: Path | None = None) -> tuple[RunMetrics, list[Finding], list[Path]]:
    """Write the PNGs and fp8_report.md; returns the metrics, the findings and the written
    paths (markdown last)."""
    metrics_file = run_folder if run_folder.is_file() else run_folder / "metrics.jsonl"
    run = _load_run(metrics_file)
    if layers is not None:
        try:
            re.compile(layers)
        except re.error as e:
            raise ReportError(f"--layers {layers!r}: bad regex ({e})") from None
    chosen = choose_layers(run, layers)
    if not chosen:
        raise ReportError(f"--layers {layers!r} matches none of the {len(run.layers)} layers "
                          f"(e.g. {run.layers[0]})")
    thresholds = _read_hparams(metrics_file.with_name("hparams.json"))
    out = out or metrics_file.parent
    _out_folder(out)
    written: list[Path] = []
    target = out
    try:
        for stat in run.stats:
            if spec(stat).plot == "heatmap" and shown(run, stat):
                target = out / f"fp8_heatmap_{stat}.png"
                draw_heatmap(run, stat, target, thresholds)
                written.append(target)
        if any(spec(s).plot == "series" for s in run.stats):
            target = out / SERIES_FILE
            draw_series(run, chosen, target)
            written.append(target)
        found = findings(run, thresholds)
        target = out / "fp8_report.md"
        target.write_text(render_report(run, found, thresholds, chosen,
                                        [p.name for p in written]))
    except OSError as e:  # a read-only folder, a full disk, a folder in the file's place
        raise ReportError(f"{target}: cannot write ({e.strerror or e})") from None
    return run, found, [*written, target]


def run(args: argparse.Namespace) -> int:
    try:
        metrics, found, written = make_report(args.run_folder, args.layers, args.out)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(worst_values(metrics)))
    shown_found = found[:MAX_PRINTED]
    print(f"{len(found)} flagged" + "".join(
        f"\n  {f.layer} {f.tensor}: {f.stat} {_fmt(f.stat, f.value)} at step {f.step} "
        f"({f.limit}; {f.steps_over} of {f.steps_logged} steps)" for f in shown_found))
    if len(found) > len(shown_found):
        print(f"  ... {len(found) - len(shown_found)} more in fp8_report.md")
    print(f"plots ({len(written) - 1} PNGs) in {written[0].parent}:")
    for path in written[:-1]:
        print(f"  {path.name}")
    print(f"written to {written[-1]}")
    return 0
