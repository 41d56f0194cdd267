"""fp8_report.md: what was flagged (with its cause and the YAML key to change), what fp8_guard
did (its fallbacks and the static YAML that does the same), the worst layers, how to read the
numbers, the plots, and the worst value per layer and tensor. Every name from the metrics is
escaped (`health.table.md_escape`) and shown by a bounded label (`health.table.short_names`)."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

import regex

from foundry_fp8.filters import filter_reason, search
from foundry_fp8.guard import (
    FALLBACK_LAYERS,
    FALLBACK_PREFIX,
    FP8_FLOPS_SHARE,
    KEPT_DECISIONS,
    OLDER_PREFIX,
    OPTION,
    is_whole_run,
    render_fallbacks,
    static_yaml,
)
from foundry_fp8.guard import whole_run as guard_whole_run
from foundry_fp8.health import Flag, RunMetrics, Thresholds, md_escape, render_table, worst_values
from foundry_fp8.health.history import no_number, whatif_rows, whatif_worst, worst_layers
from foundry_fp8.health.keys import full_forms
from foundry_fp8.health.loss import LossComparison, LossSpike
from foundry_fp8.health.plots import common_prefix
from foundry_fp8.health.rules import KEEP_OUT, SWAP, cast_order
from foundry_fp8.health.specs import badness, spec
from foundry_fp8.health.table import (
    LABEL_CHARS,
    PARTLY_WHATIF_MARK,
    WHATIF_MARK,
    bounded,
    limit_number,
    md_code,
    number,
    plural,
    short_names,
)
from foundry_fp8.health.thresholds import (
    LOSS_SPIKE_JUMP,
    LOSS_SPIKE_OPEN,
    LOSS_SPIKE_RATIO,
    LOSS_SPIKE_STEPS,
    LOSS_SPIKE_WINDOW,
)
from foundry_fp8.options import OptionError
from foundry_fp8.report.read import GuardRun, SwapFilters

#: The worst-value table (`worst_values`) and its what-if cells (`whatif_worst`).
WorstTable = tuple[dict[tuple[str, str], dict[str, float]], set[tuple[str, str, str]]]


def worst_table(run: RunMetrics) -> WorstTable:
    """The run's worst-value table and its what-if cells: made once a report (each reads every
    series), for the markdown and the terminal."""
    return worst_values(run), whatif_worst(run)


FLAGGED_HEAD = ("| layer | tensor | statistic | worst | first flagged at step | steps flagged "
                "| likely cause | change |\n|---|---|---|---|---|---|---|---|")
#: The section holding each layer of the flag rows that name several.
PER_LAYER = "Flagged layers one per row"


@dataclass(frozen=True)
class Finding:
    """One rule's flags on one layer and tensor over the run. What a line says of it (value,
    step, rule in words, cause, YAML key) is the worst flag's alone: a rule's words carry the
    numbers of their own step (NaN/Inf counts, a scale ratio)."""

    worst: Flag
    first_step: int  # the logging step it was first flagged at
    steps: int  # logging steps flagged
    logged: int  # judged logging steps of this tensor
    whatif: int = 0  # of the flagged steps, those the layer ran in high precision (what-if)
    worst_whatif: bool = False  # the worst value is a what-if one

    def counted(self, unit: str = "", each: bool = False) -> str:
        """`5 of 7`, `each` for a row of several layers, and how many of them were what-if
        numbers (`, 4 of them what-if`): `each` belongs to the count, not to the what-if part."""
        return f"{self.steps} of {self.logged}{unit}{' each' if each else ''}" + (
            f", {self.whatif} of them what-if" if self.whatif else "")

    def worst_at(self) -> str:
        """`step 25`, `what-if step 25` where the layer ran in high precision."""
        return ("what-if " if self.worst_whatif else "") + f"step {self.worst.step}"


def findings(run: RunMetrics, flags: list[Flag]) -> list[Finding]:
    """Flags grouped per (layer, tensor, rule); flagged on most of their steps first."""
    groups: dict[tuple[str, str, str], list[Flag]] = {}
    for flag in flags:
        groups.setdefault((flag.layer, flag.tensor, flag.rule), []).append(flag)
    found = []
    for (layer, tensor, _), group in groups.items():
        # an uncast row (`RunMetrics.uncast`) is judged only at the steps its NaN/Inf flag
        logged = len({step for (l_, t_, _), by_step in run.values.items()
                      if l_ == layer and t_ == tensor
                      for step in run.judged(layer, tensor, by_step)} | {f.step for f in group})
        worst = max(group, key=lambda f: badness(f.stat, f.value))
        whatif = [(layer, tensor, f.step) in run.high_precision for f in group]
        found.append(Finding(worst, group[0].step, len(group), max(logged, 1), sum(whatif),
                             (layer, tensor, worst.step) in run.high_precision))
    return sorted(found, key=lambda f: (-f.steps / f.logged, f.first_step))


def fmt(stat: str, value: float, limit: str | None = None) -> str:
    """`value` as the report prints it; beside a flag's `limit` (its rule in words), with the
    digits that tell it from the limit (`number`)."""
    shown = number(value, limit_number(limit))
    return f"{shown} %" if stat.endswith("_pct") else shown


def grouped(found: list[Finding], fallen: Collection[str]) -> list[list[Finding]]:
    """The findings as rows, in their order: those that differ only in their layer (one rule,
    tensor, statistic, steps, worst step, cause and change; the values may differ) share the
    first one's row. A run that went NaN flagged every layer at one step: 96 rows of the same
    words, the first ten filling the terminal. A layer fp8_guard ran in high precision keeps its
    own row (what it says of the change is the layer's own)."""
    rows: dict[tuple[object, ...], list[Finding]] = {}
    for n, f in enumerate(found):
        w = f.worst
        key = ((n,) if w.layer in fallen else
               (w.rule, w.tensor, w.stat, w.step, f.first_step, f.steps, f.logged, f.whatif,
                f.worst_whatif, w.cause, w.yaml_key))
        rows.setdefault(key, []).append(f)
    return list(rows.values())


#: Layers a grouped row names where no pattern names them exactly (the rest are counted).
GROUP_SHOWN = 3


#: Stands for a dotted part of digits in a grouped row's name (`blocks.<n>.ffn.down_proj`): not
#: `*`, which as a glob, or pasted into `--layers` (a regex search), selects other layers too.
NUMBER = "<n>"


def number_pattern(layers: list[str], every: Collection[str]) -> str | None:
    """`blocks.<n>.ffn.down_proj`: the layers' common name with NUMBER for the dotted parts that
    are numbers and differ, where the run's layers (`every`) with a number at each NUMBER are
    exactly these; else None."""
    parts = [layer.split(".") for layer in layers]
    if len({len(p) for p in parts}) != 1:
        return None
    pattern: list[str | None] = []  # None: any number
    for column in zip(*parts, strict=True):
        if len(set(column)) == 1:
            pattern.append(column[0])
        elif all(c.isascii() and c.isdigit() for c in column):
            pattern.append(None)
        else:
            return None

    def matches(name: str) -> bool:
        got = name.split(".")
        return len(got) == len(pattern) and all(
            (c.isascii() and c.isdigit()) if want is None else c == want
            for c, want in zip(got, pattern, strict=True))

    if {layer for layer in every if matches(layer)} != set(layers):
        return None
    return ".".join(NUMBER if want is None else want for want in pattern)


def layers_named(group: list[Finding], every: Collection[str], names: dict[str, str],
                 markdown: bool = False) -> str:
    """A row's layer (its label) or, for a grouped row, its layers in a few words: `all 96
    layers`, `24 layers 'blocks.<n>.ffn.down_proj' (every <n> in the run)` (`number_pattern`),
    else the count and the first GROUP_SHOWN labels in the run's order (`every`)."""
    place = {layer: n for n, layer in enumerate(every)}
    layers = sorted((f.worst.layer for f in group), key=lambda layer: place.get(layer, len(place)))
    show = md_code if markdown else repr
    if len(layers) == 1:
        label = names.get(layers[0], layers[0])
        return md_escape(label) if markdown else repr(label)
    if set(layers) == set(every):
        return f"all {len(layers)} layers"
    if (pattern := number_pattern(layers, every)) is not None:
        number = md_code(NUMBER) if markdown else NUMBER
        return f"{len(layers)} layers {show(bounded(pattern))} (every {number} in the run)"
    more = len(layers) - GROUP_SHOWN
    return (f"{len(layers)} layers (" + ", ".join(
        show(names.get(layer, layer)) for layer in layers[:GROUP_SHOWN])
        + (f" and {more} more" if more > 0 else "") + ")")


def values_said(group: list[Finding]) -> str:
    """A row's worst value, or the range of its layers' worst values (`12 to 340`)."""
    stat = group[0].worst.stat
    ranked = sorted((f.worst for f in group), key=lambda w: badness(stat, w.value))
    low, high = (fmt(stat, w.value, w.limit) for w in (ranked[0], ranked[-1]))
    return low if ranked[0].value == ranked[-1].value else f"{low} to {high}"


#: Flags of the first flagged step the headline names (the rest are counted).
FIRST_SHOWN = 3


def first_flags(flags: list[Flag], run: RunMetrics) -> list[Flag]:
    """The flags of the first flagged step, in the order the step cast their tensors
    (`cast_order`): where a divergence began, its origin first."""
    step = min((f.step for f in flags), default=None)
    return cast_order([f for f in flags if f.step == step], run.layers, run.tensors)


def first_flagged(run: RunMetrics, flags: list[Flag], names: dict[str, str],
                  markdown: bool = False, dump: tuple[Flag, Path] | None = None) -> str | None:
    """`First flagged at step S: <layer> <tensor> <stat> <value> (<rule>), ...`: where a
    divergence began. The tables rank flags by how many steps they held, so in a run that went
    NaN the one spike that started it (1 flagged step) came after every layer's NaN rows and
    past the terminal's first MAX_PRINTED; it is the line to read first. `dump`: a flag of that
    step and fp8_stats' dump holding its tensor there, named last."""
    if not (first := first_flags(flags, run)):
        return None
    step = first[0].step
    kinds = short_names(run.tensors)

    def said(f: Flag) -> str:
        label, kind = names.get(f.layer, f.layer), kinds.get(f.tensor, f.tensor)
        label = md_code(label) if markdown else repr(label)
        whatif = " what-if" if (f.layer, f.tensor, f.step) in run.high_precision else ""
        return (f"{label} {md_escape(kind) if markdown else kind}{whatif} "
                f"{md_escape(bounded(f.stat)) if markdown else bounded(f.stat)} "
                f"{fmt(f.stat, f.value, f.limit)} ({md_escape(f.limit) if markdown else f.limit}; "
                f"likely cause: "
                f"{md_escape(f.cause) if markdown else f.cause})")

    def dumped(f: Flag, path: Path) -> str:
        label, kind = names.get(f.layer, f.layer), kinds.get(f.tensor, f.tensor)
        if markdown:
            return f" fp8_stats' dump of {md_code(label)} {md_escape(kind)} there: {md_code(str(path))}."
        return f" fp8_stats' dump of {label!r} {kind} there: {path}."

    more = len(first) - FIRST_SHOWN
    later = len({(f.layer, f.tensor) for f in flags if f.step > step}
                - {(f.layer, f.tensor) for f in first})
    return (f"First flagged at step {step}: " + "; ".join(map(said, first[:FIRST_SHOWN]))
            + (f"; and {more} more at that step" if more > 0 else "")
            + (f". {later} other layer tensor(s) flagged later" if later else "") + "."
            + (dumped(*dump) if dump is not None else ""))


def layer_names(run: RunMetrics, guard: GuardRun | None) -> dict[str, str]:
    """Each layer's label (`short_names`: whole names, bounded, distinct), fp8_guard's too: the
    same in the markdown and on the terminal."""
    guarded = ([*(f.layer for f in guard.fallbacks), *(r.layer for r in guard.repromotions),
                *(r.layer for r in guard.refusals)] if guard is not None else [])
    return short_names([*run.layers, *guarded])


def change_key(key: str) -> str:
    """A flag's YAML key as shown: whole unless a layer name of hundreds of characters made it
    (its `exclude`, `health.rules.layers_regex`)."""
    return bounded(key, 3 * LABEL_CHARS)


def moved(guard: GuardRun, during: str = "") -> str:
    """`fp8_guard moved N layer(s) to high precision`: distinct layers, with the fallbacks
    counted apart where a layer fell back again after going back to FP8."""
    times = {s.layer: s.pairs for s in guard.summaries}  # the older pairs, counted
    for f in guard.fallbacks:
        times[f.layer] = times.get(f.layer, 0) + 1
    again = sum(n > 1 for n in times.values())
    return (f"fp8_guard moved {len(times)} layer(s) to high precision{during}" + (
        f" in {sum(times.values())} fallbacks ({again} layer(s) fell back again after going "
        "back to FP8)" if again else ""))


def fallback_steps(guard: GuardRun | None) -> dict[str, str]:
    """Layer -> when fp8_guard ran it in high precision (`from step 9`, `from step 9 to 14`)."""
    if guard is None:
        return {}
    spans: dict[str, list[str]] = {}
    for layer, decided, ended in guard.spans():
        spans.setdefault(layer, []).append(f"from step {decided + 1}"
                                           + (f" to {ended}" if ended is not None else ""))
    return {layer: ", ".join(span) for layer, span in spans.items()}


#: Joins a fallen-back layer's note (`in_high_precision`) to the change that would run it in FP8.
TO_FP8 = ", or, to run it in FP8: "


def in_high_precision(layer: str, since: str, kept_by: str | None = None,
                      whole: bool = False) -> str:
    """The note on a flagged layer that fp8_guard ran in high precision: its FP8 advice only
    matters to bring it back to FP8 (`TO_FP8` then the change, where `runs_in_fp8`). `kept_by`:
    the run's te_swap option that keeps it out of FP8 from the start already (`kept_out`: a run
    resumed with the fallback's exclude), which it is not told to add again. `whole`: the
    fp8_guard section gives no exclude (`whole_run`), which it is not pointed at."""
    head = (f"fp8_guard ran {layer} in high precision {since} (its statistics there are what-if "
            "numbers); ")
    return head + (f"the run's te_swap {kept_by} keeps it so from the start" if kept_by else
                   "FP8 is not working for the run as a whole (the fp8_guard section)" if whole
                   else "keep it so from the start with the fp8_guard section's exclude")


def to_exclude(guard: GuardRun | None, swap: SwapFilters) -> list[str]:
    """The layers in fallback at the end that the run's te_swap filters do not keep out of FP8
    already (`kept_out`): those the static YAML adds (a run resumed with the fallback's own
    exclude got it joined to itself, `(?:X)|X`)."""
    kept = guard.kept if guard is not None else []
    return [layer for layer in kept if kept_out(layer, swap) is None]


#: Said instead of the static YAML where `to_exclude` is empty (as fp8_guard's fit-end print).
ALREADY_OUT = "te_swap already keeps the layers in fallback out of FP8 (the run's config)."


#: Introduces `excluded_together`'s YAML, on the terminal and in fp8_report.md.
EXCLUDE_TOGETHER = ("The exclude changes at once (te_swap reads one exclude, so typed in turn "
                    "they keep the last one only; the run's own exclude kept): ")
#: `EXCLUDE_TOGETHER` where the YAML holds fp8_guard's layers in fallback at the end too.
EXCLUDE_TOGETHER_HELD = ("The exclude changes at once, with the layers fp8_guard held in high "
                         "precision at the end (te_swap reads one exclude, so typed in turn "
                         "beside the fp8_guard section's they keep the last one only; the run's "
                         "own exclude kept): ")


def excluded_together(found: list[Finding], fallen: Collection[str],
                      swap: SwapFilters | str | None, held: Collection[str] = ()) -> str | None:
    """One te_swap `exclude` for every flagged layer whose change is its own `exclude`, joined to
    the run's (`swap`, or its exclude alone) and to the layers fp8_guard holds in high precision
    at the end (`held`, `to_exclude`): te_swap reads one regex, so two rows' own `exclude`, or a
    row's and the fp8_guard section's, typed in turn kept the last only, and either dropped the
    run's own. None where one row says it all (one such layer, no exclude of the run's, none
    held) or the fp8_guard section's alone does (no such layer); layers the run's te_swap
    filters already keep out (`kept_out`): none (it said them again)."""
    swap = filters_of(swap)
    layers = {f.worst.layer for f in found
              if f.worst.layer not in fallen and f.worst.yaml_key.startswith(f"{SWAP}.exclude:")
              and kept_out(f.worst.layer, swap) is None}
    if not layers or (len(layers) == 1 and not swap.exclude and not held):
        return None
    return static_yaml(layers | set(held), swap.exclude)


class RunFP8(NamedTuple):
    """The run's FP8 layers: those the keys name (`names`) and how many there are (`count`, more
    where fp8_stats watched some of them only: te_swap's count)."""

    names: list[str]
    count: int


def fp8_layers(layers: Collection[str], swap: SwapFilters) -> RunFP8 | None:
    """The run's layers that te_swap's filters put in FP8 (not `kept_out`): those an exclude
    would take out of it, and te_swap's count of them; None where te_swap logged none (a run
    without FP8 layers: fp8_stats' what-if numbers only)."""
    if not swap.converted:
        return None
    names = [layer for layer in layers if kept_out(layer, swap) is None]
    return RunFP8(names, max(len(names), swap.converted))


def whole_run(out: Collection[str], fp8: RunFP8 | None, what: str,
              spike: LossSpike | None = None, flagged: int | None = None) -> str | None:
    """fp8_guard's `whole_run` (its rule and threshold, the live guard's too), naming first the
    loss's divergence (`spike`, by the first FP8 flag at step `flagged`) where there is one;
    `fp8` None: the run's FP8 layers are not known, and nothing is said."""
    if fp8 is None:
        return None
    main = spike.main(flagged) if spike is not None else None
    loss = ("" if main is None else
            f"the loss {'spikes at' if main.back is not None else 'diverges from'} step "
            f"{main.step}, ")
    return guard_whole_run(out, fp8.names, what, loss, fp8.count)


def flagged_whole(found: list[Finding], held: Collection[str], fp8: RunFP8 | None,
                  spike: LossSpike | None, flags: list[Flag]) -> str | None:
    """`whole_run` for the flagged layers and those fp8_guard held at the end (`held`), said
    in place of `excluded_together`'s line; a flag whose steps are all what-if is not FP8's."""
    return whole_run({f.worst.layer for f in found if f.whatif < f.steps} | set(held), fp8,
                     "are flagged" + (" or held in high precision" if held else ""), spike,
                     min((f.step for f in flags), default=None))


def filters_of(swap: SwapFilters | str | None) -> SwapFilters:
    """The run's te_swap filters, given whole or as its `exclude` alone."""
    return swap if isinstance(swap, SwapFilters) else SwapFilters(exclude=swap)


def kept_out(layer: str, swap: SwapFilters) -> str | None:
    """The run's te_swap option that keeps `layer` out of FP8 (`exclude`, `keep_first/last_blocks`,
    `include`), None where none does. Besides `exclude` (`swap_excluded`): te_swap's
    `filters.filter_reason` on every name the layer may have had there (`full_forms`), where each
    gets one (an include written on te_swap's full names, `^model\\.transformer\\.`, matches no
    key's name). A regex that runs out of time keeps nothing out."""
    if swap_excluded(layer, swap.exclude):
        return "exclude"
    if swap.others is None:
        return None
    try:
        reasons = [filter_reason(form, swap.others, swap.n_blocks) for form in full_forms(layer)]
    except (OptionError, regex.error):
        return None
    return reasons[0].relax if all(reasons) else None


def swap_excluded(layer: str, exclude: str | None) -> bool:
    """Whether te_swap's `exclude` (the run's) keeps `layer` out of FP8: te_swap searches the
    regex in each module name (`filters.search`), which is the key's name or one of its
    `full_forms` (`^model\\.transformer\\.blocks\\.1\\.` is not found in `blocks.1.fc`); one
    that runs out of time, or that no run's te_swap took (not a regex: the hyperparameters are
    the report's input), matches nothing."""
    try:
        return exclude is not None and any(search(f"{SWAP}.exclude", exclude, form)
                                           for form in full_forms(layer))
    except (OptionError, regex.error):
        return False


def not_converted(f: Finding, fallen: Collection[str], swap: SwapFilters | str | None
                  ) -> tuple[str, bool] | None:
    """The note on a flag whose layer fp8_guard did not move and whose numbers are all what-if:
    te_swap left it in high precision, so its advice is what running it in FP8 would take, none
    where the run's te_swap filters (`swap`, or its exclude alone) keep it out already (the
    report said its exclude, or `keep_first_blocks: 1` to a run holding it, again). As
    `Flag.whatif_message` says it during the run. A flag with FP8 numbers whose change the run's
    config (its last attempt's: resumed with that change) holds already: that no change is
    needed. The note, and whether the flag's change follows it; None for other flags (NaN/Inf
    are counted in the high-precision tensor: its own advice)."""
    w = f.worst
    if w.layer in fallen or w.rule == "nonfinite":
        return None
    by = kept_out(w.layer, filters_of(swap)) if w.yaml_key.startswith(KEEP_OUT) else None
    done = f"no change: the run's te_swap {by} keeps it out of FP8"
    if f.whatif < f.steps:
        return None if by is None else (f"{done} (the run's config at its end)", False)
    head = "it did not run in FP8 (what-if numbers)"
    if w.yaml_key.startswith(KEEP_OUT):
        return ((f"{head}; {done}", False) if by is not None else
                (f"{head}; keep it out of FP8 (where te_swap would convert it): ", True))
    return f"{head}; before putting it in FP8, change: ", True


def runs_in_fp8(key: str) -> bool:
    """Whether a flag's change would run its layer in FP8: not one of the keys that keep a layer
    out of FP8 (`keep_last_blocks: 1` for a fallen layer in the last block said "to run it in
    FP8: keep_last_blocks: 1", which does the opposite)."""
    return not key.startswith(KEEP_OUT)


def unrecorded_fallbacks(guard: GuardRun | None) -> str | None:
    """What fp8_guard's series says of fallbacks that no record in hparams.json explains (its
    logger failed, the file is cut): said so, rather than "moved no layer"."""
    seen = guard.unrecorded if guard is not None else None
    if seen is None:
        return None
    step, most, last = seen
    count, end = ((f"{most:g} layer(s)", "") if most == last else
                  (f"up to {most:g} layer(s)", f" ({last:g} at the last logging step)"))
    return (f"fp8_guard ran {count} in high precision per its series `{FALLBACK_LAYERS}`, the "
            f"first from step {step + 1}{end}; their records (`{FALLBACK_PREFIX}<layer>`: which "
            "layers, and why) are missing from hparams.json.")


#: Introduces `refused`'s YAML where the budget refused several layers.
REFUSED_TOGETHER = ("To exclude them in te_swap at once (te_swap reads one exclude, so typed in "
                    "turn they keep the last one only; the run's own exclude kept")
#: Said of `refused`'s YAML where it holds fp8_guard's layers in fallback at the end too.
REFUSED_HELD = (", with the layers fp8_guard held in high precision at the end, whose YAML it "
                "replaces")


class GuardAdvice(NamedTuple):
    """What the report advises on fp8_guard's layers, made once for fp8_report.md and the
    console (`guard_advice`)."""

    held: list[str]  # in fallback at the end, not kept out already (`to_exclude`)
    no_static: bool  # they are most of the run's FP8 layers: no static YAML of them
    whole: str | None  # the one whole-run paragraph (refused and held layers), said once


def guard_advice(guard: GuardRun | None, swap: SwapFilters, fp8: RunFP8 | None) -> GuardAdvice:
    """`GuardAdvice`: the whole-run paragraph for the refused and held layers together where
    there are refusals (it covers the held ones), else for the held ones."""
    held = to_exclude(guard, swap)
    no_static = fp8 is not None and is_whole_run(held, fp8.names, fp8.count)
    refusals = [r.layer for r in guard.refusals] if guard is not None else []
    whole = (whole_run([*refusals, *held], fp8, "are refused by fp8_guard's budget or held in "
                       "high precision" if held else "are refused by fp8_guard's budget")
             if refusals else None) or (
        whole_run(held, fp8, "are held in high precision at the end") if no_static else None)
    return GuardAdvice(held, no_static, whole)


def refused(guard: GuardRun | None, names: dict[str, str], advice: GuardAdvice,
            markdown: bool = False) -> list[str]:
    """One line per layer fp8_guard wanted to move but its budget kept in FP8 (its record
    `guard.REFUSED_PREFIX` + layer): the run's warning alone left the report saying nothing
    failed. `names`: each layer's label. One exclude for them all and the layers in fallback at
    the end (`advice.held`), last: te_swap reads one regex, so one per layer, or one beside the
    fp8_guard's static YAML, typed in turn kept the last only. Where `advice.whole` (said after
    them by the caller), no exclude nor budget to raise (it would hold them all in high
    precision)."""
    if guard is None or not guard.refusals:
        return []
    held, whole = advice.held, advice.whole
    yaml = static_yaml([*(r.layer for r in guard.refusals), *held], guard.exclude)
    yaml = md_code(yaml) if markdown else yaml
    one = len(guard.refusals) == 1
    also = f" ({REFUSED_HELD.removeprefix(', ')})" if held else ""
    lines = [f"fp8_guard wanted to move {md_escape(label) if markdown else label} at step "
             f"{r.step} but the budget refused it (share {100 * r.fallback_share:.1f} % > "
             f"max_fallback_share {100 * r.max_fallback_share:g} %)" + (
                 "" if whole else f": raise {OPTION}.max_fallback_share or exclude it in te_swap"
                 + (f"{also}: {yaml}" if one else ""))
             for r in guard.refusals
             for label in [names.get(r.layer, r.layer)]]
    if whole or one:
        return lines
    intro = f"{REFUSED_TOGETHER}{REFUSED_HELD if held else ''}): "
    return [*lines, (md_escape(intro) if markdown else intro) + yaml]


def guard_section(guard: GuardRun, names: dict[str, str], swap: SwapFilters | None = None,
                  fp8: RunFP8 | None = None) -> list[str]:
    """What fp8_guard did: the fallbacks, the FP8 FLOPs share, the static YAML for next time;
    `names`: each layer's label; `swap`: the run's te_swap filters (`to_exclude`; without them
    its exclude alone, as fp8_guard's records read it); `fp8`: the run's FP8 layers (`refused`,
    `guard_advice`)."""
    lines = ["## fp8_guard", ""]
    share = guard.fp8_share
    shares = (f" FP8 share of the linear-GEMM FLOPs (`{FP8_FLOPS_SHARE}`): {100 * share[0]:.1f} "
              f"% at the first logging step, {100 * share[1]:.1f} % at the last."
              if share else "")
    swap = swap or SwapFilters(exclude=guard.exclude)
    advice = guard_advice(guard, swap, fp8)
    held = advice.held  # the static YAML's layers, in the refused one too
    refusals = [line for r in [*refused(guard, names, advice, markdown=True),
                               *([advice.whole] if advice.whole else [])]
                for line in ("", r)]
    unrecorded = unrecorded_fallbacks(guard)
    if unrecorded:
        return [*lines, unrecorded + shares, *refusals]
    if not guard.fallbacks:
        lines.append(f"fp8_guard watched {plural(len(guard.series), 'logging step')} and moved no layer to "
                     "high precision" + (f" (FP8 share of the linear-GEMM FLOPs: "
                                         f"{100 * share[-1]:.1f} %)." if share else "."))
        return [*lines, *refusals]
    lines += [f"{moved(guard, ' during the run')}; the records are `{FALLBACK_PREFIX}<layer>` "
              "in hparams.json. Each ran in high precision from the step after the one that "
              "decided it, and its statistics since are what-if numbers (the cast it would do, "
              "under fp8_stats' `recipe`)." + shares]
    if guard.in_fallback != len(guard.kept):
        lines[-1] += (f" The series `{FALLBACK_LAYERS}` ends at {guard.in_fallback} "
                      f"layers, hparams.json records {len(guard.kept)} in fallback at the end: "
                      "part of the run's record is missing.")
    fallbacks = [replace(f, layer=names[f.layer]) for f in guard.fallbacks]
    ended = [replace(r, layer=names[r.layer]) for r in guard.repromotions]
    lines += ["", render_fallbacks(fallbacks, share[1] if share else None, ended)]
    if guard.carried is not None:
        first, layers = guard.carried
        lines += ["", f"When the steps went back ({md_code(FALLBACK_LAYERS)} "
                  f"{guard.series[first][FALLBACK_LAYERS]:g} at step {first}), "
                  f"{', '.join(md_escape(names[layer]) for layer in layers)} was already in "
                  "fallback: an earlier attempt moved it (`fit()` again with `reset_time` keeps "
                  "its fallbacks), so the table's step is that attempt's; in the steps this report"
                  f" shows it ran in high precision from step {first}."]
    if guard.summaries:
        older = "; ".join(f"{md_escape(names.get(s.layer, s.layer))}: {s.pairs} fallback/re-promotion pair(s) "
                          f"between step {s.first_step + 1} and step {s.step + 1}"
                          for s in guard.summaries)
        lines += ["", f"Older decisions counted, their records missing from the hyperparameters "
                  f"(`{OLDER_PREFIX}<layer>.ba<step>`; fp8_guard logs each layer's last "
                  f"{KEPT_DECISIONS} again at each start): {older}."]
    if guard.repromotions:
        back = "; ".join(f"{md_escape(names[r.layer])} from step {r.step + 1} (its what-if statistics "
                         f"within the limits at {r.healthy_steps} logging steps in a row)"
                         for r in guard.repromotions)
        lines += ["", f"Back in FP8 (`repromote_after`), with a fresh delayed-scaling state: "
                  f"{back}."]
    if not guard.kept:
        return [*lines, "", "No layer is in fallback at the end of the run.", *refusals]
    if not held:
        return [*lines, *refusals, "", ALREADY_OUT]
    if advice.no_static:  # the whole-run paragraph, among `refusals`, says why no YAML
        return [*lines, *refusals]
    return [*lines, *refusals, "", "The layers in fallback at the end in high precision from the start, next "
            "time (te_swap keeps them in high precision; fp8_guard then has nothing to switch):",
            "", "```yaml", static_yaml(held, swap.exclude), "```"]


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
  far below (the smallest scale in force under {stale:g} of the current scale, times 2^-margin
  for a recipe `margin`, which sets the scale that far below by design: a micro-batch or rank
  still at an old scale counts) an old spike in the amax history keeps it small and small
  values flush to 0. Columns of worst values show the value farthest from 1, on either side.
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
- **Loss spikes**: the training loss more than {loss_ratio:g}x the median of the up to
  {loss_window} finite losses logged before it at {loss_steps} logged steps in a row (one noisy
  step is none), or {loss_jump:g}x at once, or NaN/Inf, until it is back within {loss_ratio:g}x.
  The line names where the loss diverged (never came back), else the first spike at or after the
  first FP8 flag, and the spikes it came back from. A spike a few steps after the first FP8 flag
  points at that flag's layer; one before any flag, or in a run with none, points beyond FP8
  (the data, the learning rate). A log that ends {loss_open} or more logged steps in a row above
  {loss_ratio:g}x, too few for a spike yet, is named first, marked open: read while the run trains,
  a divergence may be starting there.
"""


def nothing_judged(run: RunMetrics) -> str | None:
    """The line that replaces 'No layer crosses a threshold' where the rules' statistics hold
    no number at all (`no_number`): no flag then says nothing about the run's health."""
    judged = [stat for stat in run.stats if spec(stat).worse]
    if not judged or not all(no_number(run, stat) for stat in judged):
        return None
    return (f"No layer judged: every value of {', '.join(map(bounded, judged))} is NaN at every "
            "logged step, NaN/Inf counts included (fp8_stats logs NaN statistics only beside a "
            "count of the NaN/Inf that made them): the report cannot tell whether FP8 is "
            "healthy; look at how these values were logged or copied")


def render_report(run: RunMetrics, flags: list[Flag], thresholds: Thresholds,
                  chosen: list[tuple[str, str]], pngs: list[str],
                  guard: GuardRun | None = None, matched: int | None = None,
                  dump: tuple[Flag, Path] | None = None,
                  loss: tuple[str, LossComparison] | None = None,
                  worst: WorstTable | None = None, spike: LossSpike | None = None,
                  swap: SwapFilters | None = None) -> str:
    """fp8_report.md: what to look at first, what fp8_guard did, how to read it, the plots,
    then the full table (and the layers of grouped flag rows one per row). `matched`: how many
    layers `--layers` matched, of which `chosen` are the ones drawn; `loss`: the baseline (as
    named) and the loss comparison with it; `worst`: the run's `worst_table`, when made;
    `spike`: the run's loss spikes (`spike_line`), where it logged a loss; `swap`: te_swap's
    layer filters (`read.swap_filters`; without them its exclude alone, as fp8_guard's read)."""
    table, cells = worst or worst_table(run)
    swap = swap or SwapFilters(exclude=guard.exclude if guard is not None else None)
    prefix = common_prefix(run.layers)
    names = layer_names(run, guard)
    fp8 = fp8_layers(run.layers, swap)
    kinds = short_names(run.tensors)
    shape = (f"{plural(len(run.layers), 'layer')} x {plural(len(run.tensors), 'tensor')} "
             f"({md_escape(', '.join(kinds.values()))}), {plural(len(run.steps), 'logging step')} "
             f"({run.steps[0]} to {run.steps[-1]}); statistics: "
             f"{md_escape(', '.join(short_names(run.stats).values()))}.")
    if prefix:
        shape += (f" The plots drop the common prefix {md_code(bounded(prefix))} (their titles"
                  " name it); the text names each layer in full, as the metric keys do.")
    t = thresholds
    lines = ["# FP8 health report", "", shape, "", "## Flagged", "",
             f"Thresholds from {t.source}: underflow > {t.max_underflow_pct:g} %, cos_sim < "
             f"{t.min_cos_sim:g}, any NaN/Inf, at once; overflow > {t.max_overflow_pct:g} % with "
             f"scale_ratio > {t.clip_ratio:.3g} for {plural(t.persist_steps, 'logging step')} in a row, or "
             f"with scale_ratio >= {t.spike_ratio:g} at once; gradient underflow rising "
             f"{plural(t.persist_steps, 'logging step')} in a row. The same rules warn during the run.", ""]
    found = findings(run, flags)
    fallen = fallback_steps(guard)
    if found:
        lines += [first_flagged(run, flags, names, markdown=True, dump=dump) or "", ""]
    if spike is not None:
        lines += [spike_line(spike, flags, run, names, markdown=True), ""]
    if loss is not None:
        lines += [departure(loss[1], flags, names, run, loss[0], markdown=True), ""]
    rows = grouped(found, fallen)
    shared = [f for group in rows if len(group) > 1 for f in group]
    held, no_static = guard_advice(guard, swap, fp8)[:2]

    def row(group: list[Finding]) -> str:
        f = group[0]
        w = f.worst
        layer, change = layers_named(group, run.layers, names, True), md_code(change_key(w.yaml_key))
        if (note := not_converted(f, fallen, swap)) is not None:
            change = md_escape(note[0]) + (change if note[1] else "")
        elif w.layer in fallen:
            since = fallen[w.layer]
            layer += f" (high precision {since}: fp8_guard)"
            change = md_escape(in_high_precision("it", since, kept_out(w.layer, swap),
                                                 no_static)) + (
                f"{TO_FP8}{change}" if runs_in_fp8(w.yaml_key) else "")
        return (f"| {layer} | {md_escape(kinds[w.tensor])} | {md_escape(bounded(w.stat))} | "
                f"{values_said(group)} ({f.worst_at()}) | {f.first_step} | "
                f"{f.counted(each=len(group) > 1)} | {md_escape(w.cause)} | "
                f"{change} |")

    if found:
        lines += [FLAGGED_HEAD, *map(row, rows)]
        if whole := flagged_whole(found, held, fp8, spike, flags):
            lines += ["", whole]
        elif together := excluded_together(found, fallen, swap, held):
            # a code span outside a table keeps `|` and backslashes literal (md_code is a cell's)
            shown = (md_escape(together) if any(c in together for c in "`\n\r")
                     else f"`{together}`")
            intro = EXCLUDE_TOGETHER_HELD if held else EXCLUDE_TOGETHER
            lines += ["", f"{md_escape(intro)}{shown}"]
        if shared:
            lines += ["", f"A row naming several layers holds those whose flags differ only in "
                      f"their values; each of them has its own row in [{PER_LAYER}]"
                      f"(#{PER_LAYER.lower().replace(' ', '-')})."]
    else:
        lines.append(nothing_judged(run) or "No layer crosses a threshold.")
    if guard is not None:
        lines += ["", *guard_section(guard, names, swap, fp8)]
    lines += ["", "## Worst layers (by their mean over the judged logging steps)", ""]
    whatif = whatif_rows(run)
    for stat in (s for s in run.stats if spec(s).worse and spec(s).listed):
        entries = "; ".join(
            f"{md_code(names[w.layer])} {md_escape(kinds[w.tensor])}"
            + (f" {WHATIF_MARK}" if (w.layer, w.tensor) in whatif else "") + " mean "
            f"{fmt(stat, w.mean)}, worst {fmt(stat, w.worst)} (step {w.step})"
            for w in worst_layers(run, stat))
        lines.append(f"- **{md_escape(bounded(stat))}**: " + (
            entries or ("NaN at every logged step, judged nowhere" if no_number(run, stat)
                        else "perfect everywhere")))
    lines += ["", "## How to read this", "",
              GUIDE.format(underflow=t.max_underflow_pct, overflow=t.max_overflow_pct,
                           clip=t.clip_ratio, persist=t.persist_steps, spike=t.spike_ratio,
                           stale=t.stale_ratio, cos=t.min_cos_sim, loss_ratio=LOSS_SPIKE_RATIO,
                           loss_window=LOSS_SPIKE_WINDOW, loss_steps=LOSS_SPIKE_STEPS,
                           loss_jump=LOSS_SPIKE_JUMP, loss_open=LOSS_SPIKE_OPEN),
              "## Plots", ""]
    lines += [f"![{md_escape(png)}]({quote(png)})" for png in pngs]
    more = (f" (the first {len(chosen)} of the {matched} layers `--layers` matches)"
            if matched is not None and matched > len(chosen) else "")
    lines += ["", "Time series show " + ", ".join(
        md_code(names[layer]) + (f" ({md_escape(why)})" if why else "") for layer, why in chosen)
        + more + ".", "", "## Worst value per layer and tensor", "",
        "scale_ratio shows the value farthest from 1 (above 1: overflow side; below 1: "
        "underflow side)." + (f" {WHATIF_MARK}: the row's worst values are what-if numbers, "
                              "reached only at logging steps the layer ran in high precision "
                              "(te_swap did not convert it, or fp8_guard's fallback); "
                              f"{PARTLY_WHATIF_MARK}: some of them are."
                              if cells else ""), "",
        render_table(table, cells=cells)]
    if shared:
        lines += ["", f"## {PER_LAYER}", "", "The layers of the rows above that name several.",
                  "", FLAGGED_HEAD, *(row([f]) for f in shared)]
    return "\n".join(lines)


#: Flagged layer tensors up to the loss's departure the line names (the rest are counted).
DEPARTURE_SHOWN = 5


def _pct(gap: float) -> str:
    return "NaN/Inf" if math.isnan(gap) else f"{100 * gap:+.3g} %"


def measured_gap(cmp: LossComparison) -> str:
    """The gap itself, which the departure rule (a divergence detector) does not show: a run a
    steady 4 % above its baseline never departs, yet is no match (FP8 runs that train well
    stay within about 1 %)."""
    first, last = cmp.window[0], cmp.window[-1]
    over = (f"at step {last}" if len(cmp.window) == 1 else
            f"mean over the last {len(cmp.window)} compared steps, {first} to {last}")
    said = f"Gap {_pct(cmp.mean_gap)} ({over}"
    said += f"; {_pct(cmp.last_gap)} at step {last})." if len(cmp.window) > 1 else ")."
    if cmp.mean_gap < -cmp.max_gap:
        said += (f" The run's loss is more than {100 * cmp.max_gap:g} % below the baseline's: "
                 "FP8 does not train that much better than the same training in high precision; "
                 "check first that the runs differ in FP8 alone (the same batches, optimizer, "
                 "learning-rate schedule and max_duration: a warning names the logged settings "
                 "that differ), then for a label or mask leak.")
    return said


def departure(cmp: LossComparison, flags: list[Flag], names: dict[str, str], run: RunMetrics,
              baseline: str, markdown: bool = False) -> str:
    """Where the run's loss departs from the baseline's (`health.loss.compare`) and what was
    flagged up to that step: the layers to suspect. Or that it does not diverge, over which
    steps. Either way the measured gap (`measured_gap`)."""
    base = md_code(baseline) if markdown else baseline
    limit = f"more than {100 * cmp.max_gap:g} % above it"
    if not cmp.steps:
        return (f"Loss vs the baseline {base}: no step where both logged a finite loss, nothing "
                f"compared (this run's loss ends at step {cmp.run_last}, the baseline's at "
                f"{cmp.base_last}).")
    if cmp.base_nan_from is not None and cmp.base_nan_from < cmp.run_last:
        short = (f"; the baseline's loss is NaN/Inf from step {cmp.base_nan_from}: the steps "
                 "after are not compared")
    elif cmp.base_last < cmp.run_last:
        short = (f"; the baseline's loss ends at step {cmp.base_last}, this run's at "
                 f"{cmp.run_last}: the steps after are not compared")
    else:
        short = ""
    if cmp.departed is None or cmp.loss is None or cmp.base is None:
        return (f"Loss vs the baseline {base}: no divergence at the "
                f"{plural(len(cmp.steps), 'compared step')} ({cmp.steps[0]} to {cmp.steps[-1]}; "
                f"never {limit} at {plural(cmp.gap_steps, 'compared step')} in a row, nor "
                f"NaN/Inf){short}. "
                f"{measured_gap(cmp)}")
    step = cmp.departed
    gap = (f"{100 * (cmp.loss - cmp.base) / abs(cmp.base):+.3g} %" if math.isfinite(cmp.loss)
           and cmp.base else "NaN/Inf")
    kinds = short_names(run.tensors)
    seen: dict[tuple[str, str, str], int] = {}
    for f in sorted(flags, key=lambda f: f.step):
        if f.step <= step:
            seen.setdefault((f.layer, f.tensor, f.stat), f.step)
    said = [f"{md_code(names.get(layer, layer)) if markdown else repr(names.get(layer, layer))} "
            f"{md_escape(kinds.get(tensor, tensor)) if markdown else kinds.get(tensor, tensor)} "
            f"{md_escape(bounded(stat)) if markdown else bounded(stat)} (from step {first})"
            for (layer, tensor, stat), first in seen.items()]
    more = len(said) - DEPARTURE_SHOWN
    flagged = (f"Flagged up to step {step}: " + "; ".join(said[:DEPARTURE_SHOWN])
               + (f"; and {more} more" if more > 0 else "") + "." if said else
               f"No layer flagged up to step {step}" + (
                   f" (the first at step {min(f.step for f in flags)})." if flags else "."))
    back = (f" Back within {100 * cmp.max_gap:g} % from step {cmp.back} on."
            if cmp.back is not None else "")
    return (f"Loss departs from the baseline {base} at step {step}: {number(cmp.loss)} vs "
            f"{number(cmp.base)} ({gap}; {limit} at {plural(cmp.gap_steps, 'compared step')} in "
            f"a row, or NaN/Inf; {plural(len(cmp.steps), 'step')} compared{short}).{back} {measured_gap(cmp)} "
            f"{flagged}")


#: The recovered loss spikes the loss line names on either side of the one it is about.
SPIKES_NAMED = 3


def spike_line(sp: LossSpike, flags: list[Flag], run: RunMetrics | None = None,
               names: dict[str, str] | None = None, markdown: bool = False) -> str:
    """The run's loss spike a post-mortem reads first (`LossSpike.main`: where it diverged,
    else the first at or after the first FP8 flag) and how far it is from that flag: a spike
    right after it points at FP8, one before it at something else (the data, the learning
    rate). The spikes the loss came back from are named briefly, so that one early and brief
    does not hide a later divergence. Or that the loss has none. A rise the log ends in, not yet
    a spike (`LossSpike.rising`), comes first: a report read mid-run must not call it none."""
    return _rising_line(sp) + _spike_line(sp, flags) + _first_nonfinite(sp, flags, run, names,
                                                                         markdown)


def _first_nonfinite(sp: LossSpike, flags: list[Flag], run: RunMetrics | None,
                     names: dict[str, str] | None, markdown: bool) -> str:
    """Where NaN/Inf first showed in a tensor, when a flag of another rule came first: the
    line above says how far the loss is from the first flag, which in a run that went NaN long
    after an unrelated underflow flag points at the wrong layer. With a space before it, or ''."""
    first = min((f.step for f in flags), default=None)
    main = sp.main(first)
    bad = [f for f in flags if f.rule == "nonfinite"]
    if main is None or not bad or run is None:
        return ""
    step = min(f.step for f in bad)
    if step == first or step > main.step:
        return ""
    at = cast_order([f for f in bad if f.step == step], run.layers, run.tensors)
    f = at[0]
    label = (names or {}).get(f.layer, f.layer)
    label = md_code(label) if markdown else repr(label)
    more = f", and {len(at) - 1} more tensor(s) at that step" if len(at) > 1 else ""
    tensor, stat = bounded(f.tensor), bounded(f.stat)
    if markdown:
        tensor, stat = md_escape(tensor), md_escape(stat)
    return (f" The first NaN/Inf in a tensor: step {step}, {label} {tensor} {stat} "
            f"{fmt(f.stat, f.value)}{more}.")


def _rising_line(sp: LossSpike) -> str:
    """The rise the log ends in, marked open (with a space after it), or ''."""
    rise = sp.rising
    if rise is None:
        return ""
    ratio = (f"{rise.low:.3g}x" if f"{rise.low:.3g}" == f"{rise.high:.3g}" else
             f"{rise.low:.3g}x to {rise.high:.3g}x")
    return (f"Loss rising, still open: the loss is {ratio} the median {number(rise.median)} of "
            f"the {rise.over} losses logged before it at the last {len(rise.steps)} logged "
            f"steps, from step {rise.steps[0]} up to the log's end (step {sp.last}): a "
            f"divergence may be starting (a spike once {sp.steps} in a row, or {sp.jump:g}x); "
            "read the report again later. ")


def _spike_line(sp: LossSpike, flags: list[Flag]) -> str:
    """`spike_line` without the open rise."""
    rule = (f"more than {sp.ratio:g}x the median of the up to {sp.window} finite losses logged "
            f"before at {sp.steps} logged steps in a row, or {sp.jump:g}x at once, or NaN/Inf")
    first = min((f.step for f in flags), default=None)
    main = sp.main(first)
    if main is None:
        yet = " yet" if sp.rising else ""
        return f"Loss: no spike{yet} at the logged steps {sp.first} to {sp.last} (never {rule})."
    if main.median is None:
        said = f"Loss is {number(main.loss)} at step {main.step} (the first NaN/Inf logged)"
    else:
        said = (f"Loss {'spikes at' if main.back is not None else 'diverges from'} step "
                f"{main.step}: {number(main.loss)}, {main.loss / main.median:.3g}x the median "
                f"{number(main.median)} of the {main.over} losses logged before it (the rule: "
                f"{rule})")
    if first is None:
        said += "; no FP8 flag in the run: look beyond FP8 (data, learning rate) first."
    elif first < main.step:
        said += f", {plural(main.step - first, 'step')} after the first FP8 flag (step {first})."
    elif first == main.step:
        said += ", at the step of the first FP8 flag."
    else:
        said += (f", {plural(first - main.step, 'step')} before the first FP8 flag (step {first}): the "
                 "loss went first.")
    if main.back is not None:
        said += f" Back within the ratio at step {main.back}."
    else:
        said += f" Not back within the ratio by the last logged step, {sp.last}."
    for where, spikes in (("before", [s for s in sp.spikes if s.step < main.step]),
                          ("after", [s for s in sp.spikes if s.step > main.step])):
        if spikes:
            named = ", ".join(f"{s.step} (back at {s.back})" for s in spikes[:SPIKES_NAMED])
            more = (f" and {len(spikes) - SPIKES_NAMED} more" if len(spikes) > SPIKES_NAMED
                    else "")
            said += (f" {plural(len(spikes), 'spike')} {where} it, "
                     f"recovered: at step{'s' if len(spikes) > 1 else ''} {named}{more}.")
    return said
