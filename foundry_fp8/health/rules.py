"""The flagging rules and the stateful tracker that applies them, one logging step at a time.

`HealthTracker(thresholds).update(step, table)` takes one logging step's statistics,
`{(layer, tensor): {stat: value}}`, and returns the flags raised at that step. The same tracker
serves `fp8_stats` (console warnings, summary series), the guard (how many consecutive logging
steps a layer has been bad) and `foundry-fp8 report` (which replays a run's steps through it).

Each flag names one likely cause and the one YAML key that changes it. Plain Python.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from foundry_fp8.blocks import block_index
from foundry_fp8.health.keys import FRONTS, INITIAL_SCALE, TENSORS, direction, summary_key
from foundry_fp8.health.specs import badness, worse_of
from foundry_fp8.health.table import limit_number, number, plural
from foundry_fp8.health.thresholds import DEFAULT_THRESHOLDS, Thresholds
from foundry_fp8.recipe import DELAYED_ONLY, FP8Recipe

Table = Mapping[tuple[str, str], Mapping[str, float]]
SWAP = "algorithms.te_swap"
RECIPE = f"{SWAP}.fp8_recipe"
#: The change for an amax spike, valid as written on a delayed recipe: current scaling refuses
#: the delayed-only keys (recipe.py, FP8008), so it names them.
SPIKE_CHANGE = (f"{RECIPE}.scaling: current (and remove {', '.join(DELAYED_ONLY)} where set: "
                "delayed scaling only)")
#: NaN/Inf in a high-precision tensor (the `nonfinite` rule, fp8_guard's line): no FP8 cast
#: made them (TE's amax skips NaN, current_scaling.cu:55-60 v2.18 `fmaxf`; delayed scaling keeps
#: its scale for a NaN/Inf amax, delayed_scaling.cu:140-143), and the weights the optimizer writes
#: from them are NaN: a run goes on from a checkpoint saved before that step.
NONFINITE_CAUSE = ("the run diverges: the high-precision tensor already holds NaN/Inf (no FP8 "
                   "cast made them: look at the loss and the batch at this step)")
NONFINITE_CHANGE = ("optimizer.lr (lower it, and resume from a checkpoint saved before this "
                    "step: load_path)")
#: Gradient clipping removes no NaN/Inf: a NaN/Inf gradient makes the norm NaN/Inf, and norm
#: clipping multiplies every gradient by max_norm / (norm + 1e-6), clamped to 1: NaN, or 0 (an
#: Inf element then NaN). torch 2.7 nn/utils/clip_grad.py:159-163, FSDP's clip_grad_norm_
#: fsdp/fully_sharded_data_parallel.py:1193-1199, which Composer 0.32 calls for `norm` (and
#: `value` under FSDP): algorithms/gradient_clipping/gradient_clipping.py:49-59; `value` without
#: FSDP clamps (a NaN stays).
NOT_CLIPPED = ("; gradient clipping cannot remove them (norm clipping multiplies every gradient "
               "by clipping_threshold / the NaN/Inf norm)")
#: Where a layer with what-if numbers runs (`Flag.whatif_message`).
WhatIf = Literal["fp8", "high", "fallback"]
#: The keys `HealthTracker._keep_in_bf16` advises: they keep a layer out of FP8.
KEEP_OUT = (f"{SWAP}.keep_last_blocks", f"{SWAP}.keep_first_blocks", f"{SWAP}.exclude")


@dataclass(frozen=True, slots=True)
class Flag:
    """One rule broken by one layer's tensor at one logging step. No instance dict: the
    report keeps every flag of a run (one per flagged tensor and logging step)."""

    rule: str  # e.g. "overflow_persistent"
    layer: str
    tensor: str
    step: int
    stat: str  # the statistic the rule judges
    value: float
    limit: str  # the rule in words, e.g. "> 0.01 % for 3 logging steps"
    cause: str  # the one likely cause
    yaml_key: str  # what to change, e.g. "algorithms.te_swap.keep_last_blocks: 1"
    new: bool = True  # first time this rule flags this layer and tensor

    @property
    def reading(self) -> str:
        """The statistic, its value and the rule: `underflow_pct 21.9 % (> 5 %)`; a value that
        would print as its limit gets the digits that tell them apart (`number`)."""
        percent = self.stat.endswith("_pct")
        shown = number(self.value, limit_number(self.limit), 3 if percent else 4)
        return f"{self.stat} {shown}{' %' if percent else ''} ({self.limit})"

    @property
    def message(self) -> str:
        """The warning for numbers of the layer's own FP8 casts."""
        return (f"FP8 {self.tensor} of layer '{self.layer}' at step {self.step}: {self.reading}. "
                f"Likely cause: {self.cause}. Change: {self.yaml_key}")

    def whatif_message(self, recipe: str, runs: WhatIf) -> str:
        """The warning for what-if numbers, what `recipe` (in words) would do to the tensor:
        `runs` says where the layer's GEMMs run. In high precision (`high`, never converted;
        `fallback`, moved there by fp8_guard) nothing failed in this run: a fallback gets no
        change (the guard's own warning gave the static YAML), a layer never in FP8 what it
        would take in FP8. `fp8`: it casts in FP8 with a scale not read here, so the change
        stands. NaN/Inf are counted in the high-precision tensor, before any cast: no what-if,
        `message`."""
        if self.rule == "nonfinite":
            return self.message
        where = {"fp8": "it runs in FP8 with a scale not read here",
                 "high": "it does not run in FP8",
                 "fallback": "fp8_guard runs it in high precision"}[runs]
        head = (f"FP8 what-if for the {self.tensor} of layer '{self.layer}' at step {self.step} "
                f"({where}; these numbers are what {recipe} would do to it): {self.reading}. "
                f"Likely cause: {self.cause}.")
        if runs == "fp8":
            return f"{head} Change: {self.yaml_key}"
        if runs == "fallback":
            return f"{head} No change: it stays in high precision while fp8_guard keeps it there"
        if self.yaml_key.startswith(KEEP_OUT):
            return f"{head} Keep it out of FP8 (where te_swap would convert it: {self.yaml_key})"
        return f"{head} Before putting it in FP8, change: {self.yaml_key}"


def cast_place(layers: Sequence[str], tensors: Sequence[str]
               ) -> Callable[[tuple[str, str]], tuple[bool, int, int]]:
    """The sort key of a (layer, tensor) row in the order a step casts it: the forward's (X, W)
    by layer, then the backward's (dY) from the last layer back. A fault spreads that way within
    the step: a NaN in one dY reaches the dY of every layer before it, an overflowing weight the
    activations after it and the gradients before it; in layer order the origin came last.
    `layers`, `tensors`: forward order; others after them, as given."""
    at = {layer: i for i, layer in enumerate(layers)}
    kind = {tensor: i for i, tensor in enumerate(tensors)}

    def key(row: tuple[str, str]) -> tuple[bool, int, int]:
        layer, tensor = row
        backward, i = direction(tensor) == "backward", at.get(layer)
        place = len(at) if i is None else len(at) - 1 - i if backward else i
        return backward, place, kind.get(tensor, len(kind))

    return key


def cast_order(flags: Collection[Flag], layers: Sequence[str], tensors: Sequence[str]
               ) -> list[Flag]:
    """One step's flags in the order the step cast their tensors (`cast_place`), so the tensor a
    fault began in comes first. `layers`, `tensors`: forward order (first logged)."""
    place = cast_place(layers, tensors)
    return sorted(flags, key=lambda flag: place((flag.layer, flag.tensor)))


def model_blocks(layers: Iterable[str]) -> set[int]:
    """The block numbers of a model's layers as te_swap numbers them (`blocks.block_index`,
    which its keep_first/last_blocks count): seeds `HealthTracker.blocks`, so that the edge-block
    advice names the model's edges, not those of the layers fp8_stats happens to watch."""
    return {b for layer in layers if (b := block_index(layer)) is not None}


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a name")
    return value


def _value(stats: Mapping[str, float], stat: str, default: float) -> float:
    value = stats.get(stat, default)
    return default if value != value else float(value)


def stale_scale_ratio(stats: Mapping[str, float]) -> float:
    """The ratio the stale-scale rule judges: the smallest scale in force over the current scale
    of the whole tensor (`scale / current_scale`). `scale_ratio` is the largest of the pieces'
    own (micro-batches, ranks), which the overflow rules need; a piece still at a stale scale
    pooled with one at the updated scale read 1 there. One scale: `scale_ratio` itself. Rows
    without both (hand-made tables): `scale_ratio`."""
    ratio = _value(stats, "scale_ratio", 1.0)
    scale, current = _value(stats, "scale", 0.0), _value(stats, "current_scale", 0.0)
    return scale / current if scale > 0 and current > 0 else ratio


#: What a row of a tensor its layer does not cast (`keys.UNCAST`) is judged on, by the rules,
#: the summary series, fp8_guard and the report, when it holds NaN/Inf (else it is not judged):
#: the high-precision tensor's own numbers. Its cast statistics are a what-if of a cast that
#: does not happen: logged per layer, never acted on.
UNCAST_JUDGED = ("amax", "amin", "nan_count", "inf_count")


def uncast_stats(stats: Mapping[str, float]) -> dict[str, float]:
    """An uncast row's `UNCAST_JUDGED` statistics."""
    return {s: stats[s] for s in UNCAST_JUDGED if s in stats}


def judged_table(table: Mapping[tuple[str, str], Mapping[str, float]],
                 uncast: Collection[tuple[str, str]]) -> dict[tuple[str, str], Mapping[str, float]]:
    """`table` as the rules judge it: the `uncast` rows left out, or where they hold NaN/Inf
    with their `uncast_stats` only."""
    judged = {key: stats for key, stats in table.items() if key not in uncast}
    judged.update({key: kept for key in uncast if key in table
                   and nonfinite(kept := uncast_stats(table[key]))})
    return judged


def nonfinite(stats: Mapping[str, float]) -> float:
    """A row's NaN and Inf elements, in the high-precision tensor (0 where not counted): the one
    count the `nonfinite` rule, the summary series and fp8_guard read."""
    return _value(stats, "nan_count", 0.0) + _value(stats, "inf_count", 0.0)


class DelayedRecipe(NamedTuple):
    """What of a delayed-scaling recipe the rules read: its `margin` (the scale is FP8 max /
    amax / 2**margin) and how many past amaxes its scale is taken from (None: not known):
    `amax_history_len`, 1 under `amax_compute_algo: most_recent`."""

    margin: int = 0
    history_len: int | None = None

    @classmethod
    def of(cls, recipe: FP8Recipe) -> DelayedRecipe:
        """A recipe's margin, and where it scales delayed the amaxes its scale is taken from:
        `most_recent` takes the latest one whatever the history's length (TE v2.18
        pytorch/quantization.py:1067-1075, `amax_history[0]`)."""
        if recipe.scaling != "delayed":
            return cls(recipe.margin)
        return cls(recipe.margin,
                   1 if recipe.amax_compute_algo == "most_recent" else recipe.amax_history_len)


@dataclass
class _State:
    """What the tracker remembers of one (layer, tensor)."""

    over: int = 0  # consecutive judged logging steps with overflow that clips
    bad: int = 0  # consecutive judged logging steps with a limit crossed or underflow rising
    good: int = 0  # consecutive judged logging steps without
    rising: list[float] = field(default_factory=list)  # last underflow values (gradients)


@dataclass
class HealthTracker:
    """Applies the rules to each logging step in order; remembers streaks, flags and the worst
    value of each statistic over the judged steps (not those cast with the initial scale)."""

    thresholds: Thresholds = DEFAULT_THRESHOLDS
    flags: list[Flag] = field(default_factory=list)  # every flag raised so far
    worst: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict)
    #: the (layer, tensor, stat) whose `worst` value only `update`'s `whatif` rows reached (what
    #: fp8_guard's fallback ran in high precision), no FP8 cast: `history.whatif_worst`'s rule
    #: kept step by step, one entry per cell at most (no step log)
    whatif_worst: set[tuple[str, str, str]] = field(default_factory=set)
    #: block numbers (te_swap's) of the model's layers where the caller gives them
    #: (`model_blocks`), and of the layers seen: `_keep_in_bf16` names the model's edge blocks
    blocks: set[int] = field(default_factory=set)
    #: te_swap's recipe `margin` where the caller knows it (the report: `fp8/recipe`): the
    #: persistent-overflow advice raises it by one, as TE divides the scale by 2**margin
    #: (common/recipe/__init__.py:247 v2.18): `margin: 1` told a run already at 1 changes nothing;
    #: the stale-scale rule allows for it
    margin: int = 0
    #: that recipe's `amax_history_len` where the caller knows it (the report: `fp8/recipe`),
    #: which the stale-scale advice names
    history_len: int | None = None
    #: fp8_stats' delayed what-if recipe (its `recipe`), for the rows `update` is told are
    #: what-if ones; None: those rows are judged with `margin` and `history_len`
    whatif_recipe: DelayedRecipe | None = None
    _state: dict[tuple[str, str], _State] = field(default_factory=dict)
    _raised: set[tuple[str, str, str]] = field(default_factory=set)
    #: False in a run (fp8_stats, fp8_guard): nothing there reads `flags`, which would grow by
    #: each logging step's flags for the whole run; the report's replay keeps them
    keep_flags: bool = True

    @property
    def warned(self) -> list[tuple[str, str, str]]:
        """(layer, tensor, rule) warned about so far, once each (a checkpoint carries them, so a
        resumed run does not warn them again)."""
        return sorted(self._raised)

    def update(self, step: int, table: Table, whatif: Collection[tuple[str, str]] = (),
               ) -> dict[tuple[str, str], list[Flag]]:
        """Judge one logging step; returns the flags raised at this step per (layer, tensor).
        `whatif`: the rows whose numbers are what-if ones at this step (`whatif_worst`; the
        stale-scale rule reads `whatif_recipe` for them)."""
        for layer, _ in table:
            if (block := block_index(layer)) is not None:
                self.blocks.add(block)
        raised: dict[tuple[str, str], list[Flag]] = {}
        for (layer, tensor), stats in table.items():
            if stats.get(INITIAL_SCALE):
                continue  # delayed scaling's first cast: scale 1 by design, not judged
            self._fold_worst((layer, tensor), stats, (layer, tensor) in whatif)
            recipe = (self.whatif_recipe if self.whatif_recipe is not None
                      and (layer, tensor) in whatif else DelayedRecipe(self.margin, self.history_len))
            found = self._judge(step, layer, tensor, stats, recipe)
            if found:
                raised[(layer, tensor)] = found
                if self.keep_flags:
                    self.flags.extend(found)
        return raised

    def streak(self, layer: str, tensor: str, bad: bool = True) -> int:
        """Consecutive judged logging steps (up to the last) on which this tensor crossed a
        limit or (a gradient) its underflow rose: the one count of "bad for N logging steps"
        (`bad=False`: on which it did neither). With `persist_steps=1` (the guard's tracker) a
        bad step is exactly a flagged one."""
        state = self._state.get((layer, tensor))
        return (state.bad if bad else state.good) if state else 0

    def forget(self, layer: str) -> None:
        """Drop what the tracker remembers of `layer`'s tensors (streaks, underflow trend), as
        for a layer never seen; its flags and worst values stay."""
        for key in [k for k in self._state if k[0] == layer]:
            del self._state[key]

    def state_dict(self) -> dict[str, Any]:
        """What judging later steps and the worst-value table need, as plain lists (a
        checkpoint's): streaks, underflow trends, the rules already warned about, worst values
        (and which only what-if numbers reached) and block numbers. Not `flags`, the log of every flag (unbounded; nothing a run logs
        reads it: the report replays its own)."""
        return {
            "worst": [[layer, tensor, dict(stats)]
                      for (layer, tensor), stats in self.worst.items()],
            "streaks": [[layer, tensor, s.over, s.bad, s.good, list(s.rising)]
                        for (layer, tensor), s in self._state.items()],
            "raised": [list(key) for key in sorted(self._raised)],
            "blocks": sorted(self.blocks),
            "whatif_worst": [list(key) for key in sorted(self.whatif_worst)],
        }

    def load_state_dict(self, state: Mapping[str, Any],
                        keys: Collection[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
        """Go on from `state_dict()`'s state (a resume), kept only for `keys` (None: all);
        returns the (layer, tensor) pairs left out. A malformed state raises ValueError and
        changes nothing; one without `whatif_worst` (an earlier version's) restores none."""
        def kept(layer: Any, tensor: Any) -> bool:
            key = (_text(layer), _text(tensor))
            if keys is None or key in keys:
                return True
            dropped.add(key)
            return False

        dropped: set[tuple[str, str]] = set()
        try:
            worst = {(layer, tensor): {_text(k): float(v) for k, v in stats.items()}
                     for layer, tensor, stats in state["worst"] if kept(layer, tensor)}
            streaks = {(layer, tensor): _State(int(over), int(bad), int(good),
                                               [float(v) for v in rising])
                       for layer, tensor, over, bad, good, rising in state["streaks"]
                       if kept(layer, tensor)}
            raised = {(layer, tensor, _text(rule)) for layer, tensor, rule in state["raised"]
                      if kept(layer, tensor)}
            blocks = {int(b) for b in state["blocks"]}
            whatif_worst = {(layer, tensor, _text(stat))
                            for layer, tensor, stat in state.get("whatif_worst", ())
                            if kept(layer, tensor)}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a health tracker's state ({type(e).__name__}: {e})") from e
        if keys is not None:  # those seen of layers no longer watched go; the model's stay
            blocks &= {b for layer, _ in keys if (b := block_index(layer)) is not None}
        self.worst, self._state, self._raised = worst, streaks, raised
        self.blocks = blocks | self.blocks  # the model's, where given, stay
        self.whatif_worst = whatif_worst
        return sorted(dropped)

    def _fold_worst(self, key: tuple[str, str], stats: Mapping[str, float], whatif: bool,
                    ) -> None:
        """A worse value takes the cell's what-if mark from this step; an equal one reached
        by an FP8 cast clears it."""
        row = self.worst.setdefault(key, {})
        for stat, value in stats.items():
            if stat == INITIAL_SCALE or value != value:
                continue
            old, cell = row.get(stat), (*key, stat)
            if old is None or badness(stat, float(value)) > badness(stat, old):
                row[stat] = float(value)
                (self.whatif_worst.add if whatif else self.whatif_worst.discard)(cell)
            elif value == old and not whatif:
                self.whatif_worst.discard(cell)

    def _judge(self, step: int, layer: str, tensor: str, stats: Mapping[str, float],
               recipe: DelayedRecipe) -> list[Flag]:
        t = self.thresholds
        s = self._state.setdefault((layer, tensor), _State())
        underflow = _value(stats, "underflow_pct", 0.0)
        overflow = _value(stats, "overflow_pct", 0.0)
        cos = _value(stats, "cos_sim", 1.0)
        ratio = _value(stats, "scale_ratio", 1.0)
        bad_values = nonfinite(stats)
        clips = overflow > t.max_overflow_pct and ratio > t.clip_ratio
        s.over = s.over + 1 if clips else 0
        s.rising = [*s.rising, underflow][-(t.persist_steps + 1):]
        rising = tensor == "gradient" and self._rising(s.rising)
        bad = (clips or underflow > t.max_underflow_pct or cos < t.min_cos_sim or bad_values > 0
               or rising)
        s.bad, s.good = (s.bad + 1, 0) if bad else (0, s.good + 1)
        n = t.persist_steps
        steps = f"for {n} logging steps" if n > 1 else "at a logging step"
        found: list[tuple[str, str, float, str, str, str]] = []  # rule, stat, value, limit, cause, key
        if bad_values:
            nan, inf = _value(stats, "nan_count", 0.0), _value(stats, "inf_count", 0.0)
            found.append(("nonfinite", "nan_count" if nan else "inf_count", nan or inf,
                          f"{nan:.0f} NaN and {inf:.0f} Inf elements, before any FP8 cast",
                          NONFINITE_CAUSE + (NOT_CLIPPED if direction(tensor) == "backward"
                                             else ""), NONFINITE_CHANGE))
        if overflow > t.max_overflow_pct and ratio >= t.spike_ratio:
            found.append(("overflow_spike", "overflow_pct", overflow,
                          f"> {t.max_overflow_pct:g} % with scale_ratio {ratio:.3g} >= "
                          f"{t.spike_ratio:g}",
                          "an amax spike: the tensor jumped past the scale its amax history set "
                          "(one step of it can start a range problem that stays: if this layer "
                          "is flagged again, make that flag's change instead)",
                          SPIKE_CHANGE))
        elif s.over >= n:
            found.append(("overflow_persistent", "overflow_pct", overflow,
                          f"> {t.max_overflow_pct:g} % with scale_ratio > {t.clip_ratio:.3g} "
                          f"{steps}",
                          "the tensor keeps outgrowing its delayed scale",
                          f"{RECIPE}.margin: {self.margin + 1}"))
        stale, margin = stale_scale_ratio(stats), recipe.margin
        # delayed scaling sets the scale 2**-margin below FP8 max / amax by design (TE 2.20.2
        # pytorch/quantization.py:1111): only a ratio below that times stale_ratio is stale
        stale_limit = math.ldexp(t.stale_ratio, -margin)  # 0, not OverflowError, for a huge one
        if underflow > t.max_underflow_pct and stale < stale_limit:
            found.append(("underflow_stale", "underflow_pct", underflow,
                          f"> {t.max_underflow_pct:g} % with scale / current_scale {stale:.3g} < "
                          + (f"{stale_limit:.3g} ({t.stale_ratio:g} / 2**margin {margin})"
                             if margin else f"{t.stale_ratio:g}"), *_stale_advice(recipe)))
        elif underflow > t.max_underflow_pct:
            found.append(("underflow", "underflow_pct", underflow, f"> {t.max_underflow_pct:g} %",
                          "the tensor's range is wider than FP8 holds at this layer"
                          + (f" (the recipe's margin {margin} sets its scale 2**-{margin} below "
                             "what its amax allows)" if margin else ""),
                          self._keep_in_bf16(layer)))
        elif rising:
            found.append(("underflow_rising", "underflow_pct", underflow,
                          f"rising {plural(n, 'logging step')} in a row, to > "
                          f"{t.max_underflow_pct / 5:g} %",
                          "gradients shrink toward the bottom of E5M2's range",
                          self._keep_in_bf16(layer)))
        if cos < t.min_cos_sim and not found:
            found.append(("cos_low", "cos_sim", cos, f"< {t.min_cos_sim:g}",
                          "FP8 rounding loses too much of this tensor",
                          self._keep_in_bf16(layer)))
        flags = []
        for rule, stat, value, limit, cause, key in found:
            new = (layer, tensor, rule) not in self._raised
            self._raised.add((layer, tensor, rule))
            # the texts shared with this rule's other flags, not copied into each
            flags.append(Flag(rule, layer, tensor, step, stat, value, sys.intern(limit),
                              sys.intern(cause), sys.intern(key), new))
        return flags

    def _rising(self, values: list[float]) -> bool:
        """Gradient underflow that grew at each of the last `persist_steps` logging steps, at
        least doubled, and passed a fifth of the underflow limit."""
        n = self.thresholds.persist_steps
        if len(values) <= n:
            return False
        grew = all(b > a for a, b in zip(values, values[1:], strict=False))
        return grew and values[-1] >= 2 * values[0] and values[-1] > self.thresholds.max_underflow_pct / 5

    def _keep_in_bf16(self, layer: str) -> str:
        """The YAML key keeping this layer in BF16: its edge block's count, else `exclude`.
        te_swap keeps blocks below keep_first_blocks and from its block count (the largest
        number + 1) less keep_last_blocks (`filters.filter_reason`): block 0, and the largest
        number of `blocks` (the model's where given, else only as far as the layers seen)."""
        block = block_index(layer)
        if block is not None and len(self.blocks) > 1:
            if block == max(self.blocks):
                return f"{SWAP}.keep_last_blocks: 1"
            if block == 0:
                return f"{SWAP}.keep_first_blocks: 1"
        return f"{SWAP}.exclude: '{layers_regex([layer])}'"


def _stale_advice(recipe: DelayedRecipe) -> tuple[str, str]:
    """The stale-scale rule's cause and change. A scale taken from the last amax alone (history
    1, or `most_recent`) holds no old spike, and no shorter history exists: the last step's amax
    was far above this one's, which only a scale from this step's own amax follows (it said
    `amax_history_len (shorter than 1)`)."""
    if recipe.history_len == 1:
        return ("the scale follows the previous step's amax alone (amax history 1 or "
                "most_recent), which was far above this step's: a one-step spike, or a tensor "
                "that shrinks fast", SPIKE_CHANGE)
    return ("an old amax spike in the history keeps the scale too small",
            f"{RECIPE}.amax_history_len (shorter"
            + (f" than {recipe.history_len})" if recipe.history_len else ")"))


def layers_regex(layers: Iterable[str]) -> str:
    """te_swap's `exclude` matching exactly these layers (one or more, named as in the keys) and
    the modules inside them, so that following the advice keeps no other layer out of FP8:
    te_swap searches it in its module names, a key's with the fronts `short_layer` removed or
    not (`full_forms`), so it is anchored at both ends (`fc$` also matched `blocks.0.fc` and
    `up_fc`; `layers\\.1\\.fc$`, `vision.layers.1.fc`). One layer's holds no `|`, so the
    report's tables show it as code."""
    fronts = "".join(f"(?:{re.escape(front)})?" for front in FRONTS)
    names = sorted(re.escape(layer) for layer in layers)
    # `(?:\..+)?`: and what is inside the layer: te_swap plans an excluded fused LN-MLP
    # (`<block>.ffn`) as its own up_proj/down_proj, which `ffn$` left in FP8 (swap.plan_swap)
    return f"^{fronts}" + (names[0] if len(names) == 1 else f"(?:{'|'.join(names)})") + r"(?:\..+)?$"


def summary_metrics(table: Table, raised: Mapping[tuple[str, str], list[Flag]],
                    left_out: Collection[tuple[str, str]] = ()) -> dict[str, float]:
    """This step's summary series (`health.keys.SUMMARIES`), per tensor kind and overall:
    worst values over the judged layers, layers flagged at this step, NaN/Inf elements.

    `left_out`: rows whose worst values and flags the summary does not count, the what-if rows
    of layers fp8_guard already runs in high precision (its `fp8/guard/...` series report them),
    so an alert on `fp8/flagged_layers` stops once the guard has acted. NaN/Inf still count: they
    are in the high-precision tensor, whatever it is cast to."""
    metrics: dict[str, float] = {}
    tensors = [t for t in TENSORS if any(k[1] == t for k in table)]
    tensors += sorted({k[1] for k in table} - set(tensors))
    counted = {key: stats for key, stats in table.items() if key not in left_out}
    flagged = [key for key in raised if key not in left_out]
    for tensor in tensors:
        rows = [stats for (_, t), stats in counted.items()
                if t == tensor and not stats.get(INITIAL_SCALE)]
        for name, stat, default in (("worst_underflow_pct", "underflow_pct", 0.0),
                                    ("worst_overflow_pct", "overflow_pct", 0.0),
                                    ("worst_cos_sim", "cos_sim", 1.0)):
            values = [float(r[stat]) for r in rows if stat in r and r[stat] == r[stat]]
            worst = default
            for v in values:
                worst = worse_of(stat, worst, v)
            metrics[summary_key(tensor, name)] = worst
        metrics[summary_key(tensor, "flagged_layers")] = float(
            len({layer for (layer, t) in flagged if t == tensor}))
        metrics[summary_key(tensor, "nonfinite")] = sum(
            nonfinite(stats) for (_, t), stats in table.items() if t == tensor)
    metrics[summary_key(None, "flagged_layers")] = float(len({layer for layer, _ in flagged}))
    return metrics
