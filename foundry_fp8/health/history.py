"""A run's FP8 statistics over its logging steps, `values[(layer, tensor, stat)][step]`: what
the report reads from metrics.jsonl and `fp8_stats` keeps for its images. Plain Python."""

from __future__ import annotations

import math
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from foundry_fp8 import jsonl
from foundry_fp8.health.keys import (
    HIGH_PRECISION,
    INITIAL_SCALE,
    TENSORS,
    UNCAST,
    by_name,
    parse_key,
)
from foundry_fp8.health.rules import judged_table
from foundry_fp8.health.specs import PERFECT, SPECS, badness, known_first, spec

NAN = float("nan")


class Series(Mapping[int, float]):
    """One statistic of one layer's tensor, step -> value in step order, kept as two arrays (16
    bytes a logging step): as a dict, a 1 GB metrics.jsonl's 16.6 million numbers took 2 GB."""

    __slots__ = ("_steps", "_values")

    def __init__(self) -> None:
        self._steps = array("q")
        self._values = array("d")

    def _at(self, step: int) -> int:
        return bisect_left(self._steps, step)

    def __setitem__(self, step: int, value: float) -> None:
        steps = self._steps
        if not steps or step > steps[-1]:  # a run logs its steps in order
            steps.append(step)
            self._values.append(value)
            return
        i = self._at(step)
        if steps[i] == step:
            self._values[i] = value
        else:
            steps.insert(i, step)
            self._values.insert(i, value)

    def __getitem__(self, step: int) -> float:
        i = self._at(step)
        if i < len(self._steps) and self._steps[i] == step:
            return self._values[i]
        raise KeyError(step)

    def __contains__(self, step: object) -> bool:
        try:
            self[step]  # type: ignore[index]
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[int]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)

    def __repr__(self) -> str:
        return f"Series({dict(self.items())!r})"

    def items(self) -> Iterator[tuple[int, float]]:  # type: ignore[override]
        return zip(self._steps, self._values, strict=True)

    def values(self) -> Iterator[float]:  # type: ignore[override]
        return iter(self._values)

    def drop_from(self, step: int) -> None:
        """Forget `step` and every later one."""
        i = self._at(step)
        del self._steps[i:]
        del self._values[i:]


@dataclass
class RunMetrics:
    """The per-layer FP8 statistics of one run; steps cast with delayed scaling's initial
    scale are in `initial` (drawn, but neither ranked nor flagged), those of a layer that ran
    in high precision (fp8_guard's fallback, or not converted) in `high_precision` (what-if numbers: drawn hatched, tables say so),
    those of a tensor its layer's FP8 run does not cast (`keys.UNCAST`) in `uncast` (what-if
    numbers: drawn hatched, judged only on NaN/Inf as fp8_stats does)."""

    values: dict[tuple[str, str, str], Series] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)  # first-logged order; the model's: in_order
    tensors: list[str] = field(default_factory=list)
    stats: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # every step with any fp8 metric, sorted
    initial: set[tuple[str, str, int]] = field(default_factory=set)
    high_precision: set[tuple[str, str, int]] = field(default_factory=set)
    uncast: set[tuple[str, str, int]] = field(default_factory=set)
    later_attempt: int | None = None  # the step the last later attempt logged from (drop_from)
    # `steps` as a set: a list search per value would make reading a run quadratic in its steps
    _step_set: set[int] = field(default_factory=set, init=False, repr=False, compare=False)

    def add(self, step: int, layer: str, tensor: str, stat: str, value: float) -> None:
        """One number; a step logged twice (a resumed run appending) keeps the later value."""
        marked = {INITIAL_SCALE: self.initial, HIGH_PRECISION: self.high_precision,
                  UNCAST: self.uncast}.get(stat)
        if marked is not None:
            if value:
                marked.add((layer, tensor, step))
            return
        by_step = self.values.get((layer, tensor, stat))
        if by_step is None:  # the names' lists are searched once per series, not per value
            by_step = self.values[(layer, tensor, stat)] = Series()
            for names, name in ((self.layers, layer), (self.tensors, tensor), (self.stats, stat)):
                if name not in names:
                    names.append(name)
        if step not in self._step_set:
            self._step_set.add(step)
            self.steps.append(step)
        by_step[step] = float(value)

    def drop_from(self, step: int) -> None:
        """Forget every number and mark at `step` and after: a later attempt of the run (a resume
        from a checkpoint) logs those steps again, and its numbers alone stand there."""
        self.later_attempt = step
        for name, by_step in list(self.values.items()):
            by_step.drop_from(step)
            if not by_step:  # a series only the earlier attempt logged there: no row, no column
                del self.values[name]
        for i, names in enumerate((self.layers, self.tensors, self.stats)):
            kept = {name[i] for name in self.values}
            names[:] = [name for name in names if name in kept]
        for marked in (self.initial, self.high_precision, self.uncast):
            marked -= {m for m in marked if m[2] >= step}
        self.steps = [s for s in self.steps if s < step]
        self._step_set = set(self.steps)

    def in_order(self, order: Sequence[str] | None) -> None:
        """`layers` in the model's order `order` (fp8_stats' record, `keys.layer_order`), those
        it lacks after them by name; None: all by name (`keys.by_name`). `values` follows (by
        layer, tensor, statistic): the tables, rankings and replayed flags read it in its order,
        which was the order each sink gave the keys in."""
        at = {layer: i for i, layer in enumerate(order or ())}
        self.layers.sort(key=lambda layer: (at.get(layer, len(at)), by_name(layer)))
        places = [{name: i for i, name in enumerate(names)}
                  for names in (self.layers, self.tensors, self.stats)]
        self.values = {key: self.values[key] for key in sorted(
            self.values, key=lambda key: tuple(place[name] for place, name in zip(
                places, key, strict=True)))}

    def add_table(self, step: int, table: Mapping[tuple[str, str], Mapping[str, float]]) -> None:
        """One logging step's `{(layer, tensor): {stat: value}}`."""
        for (layer, tensor), stats in table.items():
            for stat, value in stats.items():
                self.add(step, layer, tensor, stat, value)
        self.tidy()

    def tidy(self) -> None:
        """Known tensors and statistics first, steps sorted."""
        self.tensors = known_first(self.tensors, TENSORS)
        self.stats = known_first(self.stats, SPECS)
        self.steps.sort()

    def judged(self, layer: str, tensor: str, by_step: Mapping[int, float]) -> dict[int, float]:
        """`by_step` without the steps cast with the initial scale or not cast at all."""
        return {step: v for step, v in by_step.items()
                if (layer, tensor, step) not in self.initial
                and (layer, tensor, step) not in self.uncast}

    def tables(self) -> Iterator[tuple[int, dict[tuple[str, str], Mapping[str, float]]]]:
        """(step, table) in step order, as `fp8_stats` judged them (initial casts marked, uncast
        rows as `rules.judged_table` keeps them)."""
        initial: dict[int, list[tuple[str, str]]] = {}
        for layer, tensor, step in self.initial:
            initial.setdefault(step, []).append((layer, tensor))
        # one step's table at a time, each series read once through (a copy of every number
        # grouped by step would double what the run holds)
        read = [(layer, tensor, stat, iter(logged.items()))
                for (layer, tensor, stat), logged in self.values.items()]
        ahead: list[tuple[int, float] | None] = [next(it, None) for *_, it in read]
        for step in sorted(self._step_set):
            table: dict[tuple[str, str], dict[str, float]] = {}
            for n, (layer, tensor, stat, it) in enumerate(read):
                point = ahead[n]
                if point is not None and point[0] == step:
                    table.setdefault((layer, tensor), {})[stat] = point[1]
                    ahead[n] = next(it, None)
            for row in initial.get(step, ()):
                if row in table:
                    table[row][INITIAL_SCALE] = 1.0
            yield step, judged_table(table, {(layer, tensor) for layer, tensor in table
                                             if (layer, tensor, step) in self.uncast})


def collect(records: Iterable[tuple[int, Mapping[str, Any]]], run: RunMetrics | None = None
            ) -> RunMetrics:
    """The per-layer numbers (`health.keys` layout) of `(step, metrics)` records, added to `run`
    (a new one by default); values that are no number (`jsonl.number`) are left out."""
    run = RunMetrics() if run is None else run
    keys: dict[str, tuple[str, str, str] | None] = {}  # each key parsed once, not per step
    for step, metrics in records:
        for name, value in metrics.items():
            parsed = keys[name] if name in keys else keys.setdefault(name, parse_key(name))
            if parsed is None or (number := jsonl.number(value)) is None:
                continue
            stat, tensor, layer = parsed
            run.add(step, layer, tensor, stat, number)
    run.tidy()
    return run


def whatif_rows(run: RunMetrics) -> set[tuple[str, str]]:
    """The (layer, tensor) rows judged at some logging step with what-if numbers (fp8_guard ran
    the layer in high precision): their worst values may be what-if ones."""
    marked = run.high_precision - run.initial
    rows = {(layer, tensor) for layer, tensor, _ in marked}
    return {(layer, tensor) for (layer, tensor, _), by_step in run.values.items()
            if (layer, tensor) in rows and any((layer, tensor, s) in marked for s in by_step)}


def whatif_worst(run: RunMetrics) -> set[tuple[str, str, str]]:
    """The (layer, tensor, stat) whose worst value over the judged steps (`worst_values`) no
    step of the layer's own FP8 casts reached: only what-if numbers did (fp8_guard ran the layer
    in high precision there). A row judged with what-if numbers at some step may still have
    every worst value from real FP8 casts."""
    marked = run.high_precision - run.initial
    rows = {(layer, tensor) for layer, tensor, _ in marked}
    cells = set()
    for (layer, tensor, stat), logged in run.values.items():
        if (layer, tensor) not in rows:  # never in high precision: each worst value is FP8's
            continue
        point = worst_point(stat, judged := run.judged(layer, tensor, logged)) if spec(
            stat).worse else None
        if point is not None and all((layer, tensor, step) in marked
                                     for step, value in judged.items() if value == point[1]):
            cells.add((layer, tensor, stat))
    return cells


def heatmap_matrix(run: RunMetrics, stat: str, tensor: str) -> list[list[float]]:
    """Rows `run.layers`, columns `run.steps`; NaN where not logged or cast with the initial
    scale (marked, not coloured as the worst cells)."""
    column = {step: i for i, step in enumerate(run.steps)}
    rows = {layer: [NAN] * len(run.steps) for layer in run.layers}
    for layer, row in rows.items():
        for step, value in run.values.get((layer, tensor, stat), {}).items():
            if step in column:
                row[column[step]] = value
    for layer, t, step in run.initial:
        if t == tensor and layer in rows and step in column:
            rows[layer][column[step]] = NAN
    return list(rows.values())


def series(run: RunMetrics, layer: str, tensor: str, stat: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one layer's statistic, in step order."""
    by_step = run.values.get((layer, tensor, stat))
    return (list(by_step), list(by_step.values())) if by_step is not None else ([], [])


def worst_point(stat: str, by_step: Mapping[int, float]) -> tuple[int, float] | None:
    """(step, value) of the worst finite value; NaN never hides a real bad value."""
    finite = [(s, v) for s, v in by_step.items() if v == v]
    return max(finite, key=lambda sv: badness(stat, sv[1])) if finite else None


def worst_values(run: RunMetrics) -> dict[tuple[str, str], dict[str, float]]:
    """(layer, tensor) -> worst value of each ranked statistic over the judged steps."""
    table: dict[tuple[str, str], dict[str, float]] = {}
    for (layer, tensor, stat), logged in run.values.items():
        point = worst_point(stat, run.judged(layer, tensor, logged)) if spec(stat).worse else None
        if point is not None:
            table.setdefault((layer, tensor), {})[stat] = point[1]
    return table


@dataclass(frozen=True)
class Ranked:
    layer: str
    tensor: str
    mean: float  # over the judged steps: the typical state
    worst: float
    step: int  # where the worst was


def worst_layers(run: RunMetrics, stat: str, n: int = 3) -> list[Ranked]:
    """The `n` (layer, tensor) pairs with the worst mean of `stat`, leaving out perfect ones."""
    ranked = []
    for (layer, tensor, s), logged in run.values.items():
        by_step = run.judged(layer, tensor, logged) if s == stat else None
        point = worst_point(stat, by_step) if by_step else None
        if point is not None:
            finite = [v for v in by_step.values() if math.isfinite(v)]
            # plain sum: inf for values near 1e308, where math.fsum/fmean raise OverflowError
            mean = sum(finite) / len(finite) if finite else point[1]
            ranked.append(Ranked(layer, tensor, mean, point[1], point[0]))
    ranked.sort(key=lambda r: -badness(stat, r.mean))
    perfect = PERFECT.get(spec(stat).worse or "", NAN)
    return [r for r in ranked[:n] if r.mean != perfect]


def no_number(run: RunMetrics, stat: str) -> bool:
    """Whether `stat` was logged and holds no number at any judged step of any layer (every
    value NaN): fp8_stats logs a NaN statistic only beside a NaN/Inf count that says why, so a
    run of NaN alone was judged nowhere, which 'perfect everywhere' would hide."""
    logged = [run.judged(layer, tensor, by_step)
              for (layer, tensor, s), by_step in run.values.items() if s == stat]
    return any(logged) and not any(v == v for by_step in logged for v in by_step.values())


def all_zero(run: RunMetrics, stat: str) -> bool:
    return all(v == 0 for (_, _, s), by_step in run.values.items() if s == stat
               for v in by_step.values())


def shown(run: RunMetrics, stat: str) -> bool:
    """Whether a statistic earns a plot (NaN/Inf counts only when some were seen)."""
    return stat in run.stats and not (spec(stat).quiet_when_zero and all_zero(run, stat))
