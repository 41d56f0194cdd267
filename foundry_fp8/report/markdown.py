"""fp8_report.md: what was flagged (with its cause and the YAML key to change), the worst
layers, how to read the numbers, the plots, and the worst value per layer and tensor. Every
name from the metrics is escaped (`health.table.md_escape`)."""

from __future__ import annotations

from dataclasses import dataclass

from foundry_fp8.health import Flag, RunMetrics, Thresholds, md_escape, render_table, worst_values
from foundry_fp8.health.history import worst_layers
from foundry_fp8.health.plots import common_prefix
from foundry_fp8.health.specs import badness, spec
from foundry_fp8.health.table import md_code, number


@dataclass(frozen=True)
class Finding:
    """One rule's flags on one layer and tensor over the run."""

    first: Flag  # the first flag (its step, cause and YAML key)
    worst: Flag
    steps: int  # logging steps flagged
    logged: int  # judged logging steps of this tensor


def findings(run: RunMetrics, flags: list[Flag]) -> list[Finding]:
    """Flags grouped per (layer, tensor, rule); flagged on most of their steps first."""
    groups: dict[tuple[str, str, str], list[Flag]] = {}
    for flag in flags:
        groups.setdefault((flag.layer, flag.tensor, flag.rule), []).append(flag)
    found = []
    for (layer, tensor, _), group in groups.items():
        logged = len({step for (l_, t_, _), by_step in run.values.items()
                      if l_ == layer and t_ == tensor
                      for step in run.judged(layer, tensor, by_step)})
        worst = max(group, key=lambda f: badness(f.stat, f.value))
        found.append(Finding(group[0], worst, len(group), max(logged, 1)))
    return sorted(found, key=lambda f: (-f.steps / f.logged, f.first.step))


def fmt(stat: str, value: float) -> str:
    return f"{number(value)} %" if stat.endswith("_pct") else number(value)


GUIDE = """\
- **underflow_pct**: share of elements that are non-zero in high precision and 0 after the FP8
  cast. A healthy run stays under 0.2 % after its first cast; above {underflow:g} % the layer
  loses information. On gradients (E5M2: more range, less precision) a steady climb means very
  small gradients reach that layer.
- **overflow_pct**: share of elements above the FP8 max at the scale in force (they saturate).
  Under delayed scaling a slowly growing tensor saturates its largest element or two at nearly
  every step with scale_ratio within 1 % of 1: that clips them less than FP8 rounding moves
  them, and is not flagged. Flagged: overflow above {overflow:g} % with scale_ratio above
  {clip:.3g} for {persist} logging steps in a row, or with scale_ratio {spike:g} or more at once
  (an amax spike). Under current scaling it is 0 by construction.
- **scale_ratio** = scale in force / current scale (FP8 max / amax). About 1: the amax history
  fits the tensor. **Above 1** (overflow side): the tensor outgrew its scale and its largest
  elements saturate. **Below 1** (underflow side): the scale is smaller than the tensor needs;
  far below (under {stale:g}) an old spike in the amax history keeps it small and small values
  flush to 0. Columns of worst values show the value farthest from 1, on either side.
- **cos_sim**: cosine similarity of a tensor with its FP8 round trip; healthy E4M3 tensors sit
  near 0.9996, E5M2 gradients near 0.9985. Below {cos:g} the FP8 copy points elsewhere.
- **rel_mse**: error of the round trip relative to the tensor's own size
  (‖x − fp8(x)‖² / ‖x‖²), comparable across layers: about 1e-3 for E4M3 and 3e-3 for E5M2 when
  healthy. (`mse` is in the tensor's units², so large weights look worse just for being large.)
- **step 0 under delayed scaling** casts with the initial scale 1 (no amax history yet): such
  casts are logged with `fp8_initial_scale` = 1, drawn grey in the heatmaps, and neither flagged
  nor counted as worst values.
- **amax**: largest magnitude. Spikes of 10x or a steady climb come before loss divergence; the
  layer whose amax moves first is where to look.
"""


def render_report(run: RunMetrics, flags: list[Flag], thresholds: Thresholds,
                  chosen: list[tuple[str, str]], pngs: list[str]) -> str:
    """fp8_report.md: what to look at first, how to read it, the plots, then the full table."""
    prefix = common_prefix(run.layers)
    shape = (f"{len(run.layers)} layers x {len(run.tensors)} tensors "
             f"({md_escape(', '.join(run.tensors))}), {len(run.steps)} logging steps "
             f"({run.steps[0]} to {run.steps[-1]}); statistics: "
             f"{md_escape(', '.join(run.stats))}.")
    if prefix:
        shape += f" Plots and lists drop the common prefix {md_code(prefix)}."
    t = thresholds
    lines = ["# FP8 health report", "", shape, "", "## Flagged", "",
             f"Thresholds from {t.source}: underflow > {t.max_underflow_pct:g} %, cos_sim < "
             f"{t.min_cos_sim:g}, any NaN/Inf, at once; overflow > {t.max_overflow_pct:g} % with "
             f"scale_ratio > {t.clip_ratio:.3g} for {t.persist_steps} logging steps in a row, or "
             f"with scale_ratio >= {t.spike_ratio:g} at once; gradient underflow rising "
             f"{t.persist_steps} logging steps in a row. The same rules warn during the run.", ""]
    found = findings(run, flags)
    if found:
        lines += ["| layer | tensor | statistic | worst | first flagged at step | steps flagged "
                  "| likely cause | change |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {md_escape(f.first.layer)} | {md_escape(f.first.tensor)} | "
                  f"{f.worst.stat} | {fmt(f.worst.stat, f.worst.value)} | {f.first.step} | "
                  f"{f.steps} of {f.logged} | {md_escape(f.first.cause)} | "
                  f"{md_code(f.first.yaml_key)} |" for f in found]
    else:
        lines.append("No layer crosses a threshold.")
    lines += ["", "## Worst layers (by their mean over the judged logging steps)", ""]
    for stat in (s for s in run.stats if spec(s).worse and spec(s).listed):
        entries = "; ".join(
            f"{md_code(w.layer.removeprefix(prefix))} {md_escape(w.tensor)} mean "
            f"{fmt(stat, w.mean)}, worst {fmt(stat, w.worst)} (step {w.step})"
            for w in worst_layers(run, stat))
        lines.append(f"- **{md_escape(stat)}**: {entries or 'perfect everywhere'}")
    lines += ["", "## How to read this", "",
              GUIDE.format(underflow=t.max_underflow_pct, overflow=t.max_overflow_pct,
                           clip=t.clip_ratio, persist=t.persist_steps, spike=t.spike_ratio,
                           stale=t.stale_ratio, cos=t.min_cos_sim),
              "## Plots", ""]
    lines += [f"![{png}]({png})" for png in pngs]
    lines += ["", "Time series show " + ", ".join(
        md_code(layer) + (f" ({md_escape(why)})" if why else "") for layer, why in chosen)
        + ".", "", "## Worst value per layer and tensor", "",
        "scale_ratio shows the value farthest from 1 (above 1: overflow side; below 1: "
        "underflow side).", "", render_table(worst_values(run))]
    return "\n".join(lines)
