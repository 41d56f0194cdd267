"""FP8 health: the metric key layout, thresholds, flagging rules (which side of a statistic is
worse, the cause and YAML key of each warning), the tracker that applies them step by step, the
worst-value table and the plots. Used by `fp8_stats`, the guard and `foundry-fp8 report`.
Torch-free; matplotlib (and Pillow) only inside the drawing functions of `health.plots` (the report's
figures) and `health.raster` (the images fp8_stats logs)."""

from foundry_fp8.health.history import RunMetrics, collect, worst_values
from foundry_fp8.health.keys import (
    INITIAL_SCALE,
    SUMMARIES,
    TENSORS,
    direction,
    layer_key,
    parse_key,
    short_layer,
    summary_key,
)
from foundry_fp8.health.rules import Flag, HealthTracker, WhatIf, nonfinite, summary_metrics
from foundry_fp8.health.specs import SPECS, StatSpec, badness, spec, worse_of
from foundry_fp8.health.table import md_escape, plural, render_table
from foundry_fp8.health.thresholds import DEFAULT_THRESHOLDS, Thresholds

__all__ = [
    "DEFAULT_THRESHOLDS", "INITIAL_SCALE", "SPECS", "SUMMARIES", "TENSORS", "Flag",
    "HealthTracker", "RunMetrics", "StatSpec", "Thresholds", "WhatIf", "badness", "collect",
    "direction", "layer_key", "md_escape", "nonfinite", "parse_key", "plural", "render_table", "short_layer", "spec",
    "summary_key", "summary_metrics", "worse_of", "worst_values",
]
