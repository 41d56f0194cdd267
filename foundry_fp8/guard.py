"""fp8_guard's decisions, plain Python: which FP8 layers fall back to high precision, at which
logging step, within what budget, and what to write in the YAML next time.

The judgement is the health package's (`HealthTracker`: the same rules as `fp8_stats`' advice
and `foundry-fp8 report`), applied to each logging step on its own with the guard's thresholds;
an FP8 layer falls back once one of its tensors has been bad (the tracker's `streak`) at
`consecutive` logging steps in a row, so a single amax spike does not move a layer; nor does a
stale scale (`underflow_stale`: an old spike in the amax history) that lasts no longer than
that history, which rolls the spike out by itself (`GuardCore._transient`). A layer with
NaN/Inf in any of its high-precision tensors is not judged at that logging step
(`nonfinite_rows`): no FP8 cast made them, so no fallback fixes them; the other layers are judged
as usual (one inf weight that FP8's saturating cast lets training run with would otherwise blind
the guard for the rest of the run). A NaN in an activation reaches every later layer and every
gradient, so there no layer is judged. A guard that resumes from a checkpoint replays each
tensor's last judged rows (a layer unjudged at the last steps keeps its older ones) into a fresh
tracker, so its streaks, and so its decisions, are those of the run that did not stop.

With `repromote_after`, a layer in fallback runs in FP8 again once every what-if statistic
that fp8_stats computes for it (the cast it would do, under fp8_stats' `recipe`) has been within
the limits at `repromote_after` logging steps in a row (the tracker's streak of good steps).

What the callback logs, by these names (`foundry-fp8 report` reads them back): the series
`FALLBACK_LAYERS`, `FP8_FLOPS_SHARE` and `IN_FALLBACK_PREFIX` + each layer moved at each
logging step, and each fallback and re-promotion once as a hyperparameter (`FALLBACK_PREFIX` /
`REPROMOTION_PREFIX` + layer, with `.ba<step>` after the first time of a layer; the record as
plain data; a layer's first `KEPT_DECISIONS` pairs, then `OLDER_PREFIX` summaries at 1, 2, 4,
... pairs), and the first time the
budget keeps a candidate in FP8 (`REFUSED_PREFIX` + layer): a warning alone left the report
saying the guard moved nothing, as if no layer had failed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from foundry_fp8 import jsonl
from foundry_fp8.health import (
    TENSORS,
    Flag,
    HealthTracker,
    Thresholds,
    direction,
    md_escape,
    nonfinite,
)
from foundry_fp8.health.rules import (
    NONFINITE_CHANGE,
    NOT_CLIPPED,
    SWAP,
    cast_place,
    layers_regex,
)
from foundry_fp8.health.specs import known_first
from foundry_fp8.health.table import plural
from foundry_fp8.options import FP8GuardOptions as GuardConfig

Table = Mapping[tuple[str, str], Mapping[str, float]]
OPTION = GuardConfig.PATH
FALLBACK_LAYERS = "fp8/guard/fallback_layers"  # layers in fallback
FP8_FLOPS_SHARE = "fp8/guard/fp8_flops_share"  # share of the linear-GEMM FLOPs still in FP8
FALLBACK_PREFIX = "fp8/guard/fallback/"  # + layer: one hyperparameter per fallback
REPROMOTION_PREFIX = "fp8/guard/repromotion/"  # + layer: one per re-promotion
REFUSED_PREFIX = "fp8/guard/refused/"  # + layer: its first refusal by the budget
OLDER_PREFIX = "fp8/guard/summary/"  # + layer + `.ba<step>`: its older pairs, counted
#: + layer: a series, 1 while the layer is in fallback (from the next step), 0 once back in FP8;
#: the report takes every span's steps from it, as no record is logged past KEPT_DECISIONS
IN_FALLBACK_PREFIX = "fp8/guard/in_fallback/"
#: per layer, the fallback/re-promotion pairs kept whole (checkpoint, records); older ones are
#: counted in one `Summary`: a layer flipping all run grew both by ~1.4 kB a pair, and each
#: decision logged every record again. Only a layer's first KEPT_DECISIONS pairs are logged, and
#: its summaries at 1, 2, 4, 8, ... pairs: loggers keep every key ever given (W&B's config, a
#: column each in its runs table), so a layer flipping all run grew them by ~3.4 kB a pair
KEPT_DECISIONS = 4
FALLBACKS_KEY = "fp8/guard/fallbacks"  # the fit-end table (`destinations.FitEndKeys`)
#: GuardCore's state: its recent rows hold no re-promoted layer's rows up to its re-promotion
REPROMOTED_ROWS_DROPPED = "repromoted_rows_dropped"


def _plain(numbers: Mapping[str, float]) -> dict[str, float | str]:
    """Numbers as JSON that equals itself read back: NaN/Inf as strings."""
    return {k: v if math.isfinite(v) else str(v) for k, v in numbers.items()}


def _fields(item: Any, **read: Callable[[Any], Any]) -> dict[str, Any]:
    """A record's fields, each that `read` names checked and converted by its reader, so that
    a record of the wrong shape (hparams.json is anyone's file) is a ValueError, not any error
    later; a field missing or unknown is the dataclass's TypeError."""
    if not isinstance(item, Mapping):
        raise ValueError(f"not a record: a {type(item).__name__}")
    return {key: read[key](value) if key in read else value for key, value in item.items()}


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got a {type(value).__name__}")
    return value


def _texts(value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of strings, got a {type(value).__name__}")
    return tuple(map(_text, value))


def _integer(value: Any) -> int:
    """A step or a count of steps (`jsonl.step`)."""
    integer = jsonl.step(value)
    if integer is None:
        an_int = isinstance(value, int) and not isinstance(value, bool)
        got = "one out of that range" if an_int else f"a {type(value).__name__}"
        raise ValueError(f"expected {jsonl.STEP_RANGE}, got {got}")
    return integer


def _number(value: Any) -> float:
    """A number, NaN/Inf also as their strings (`_plain`)."""
    number = jsonl.number(float(value) if isinstance(value, str) else value)
    if number is None:
        raise ValueError(f"expected a number, got a {type(value).__name__}")
    return number


def _numbers(value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise ValueError(f"expected an object of numbers, got a {type(value).__name__}")
    return {_text(k): _number(v) for k, v in value.items()}


def nonfinite_rows(table: Table) -> list[tuple[str, str]]:
    """The (layer, tensor) rows whose high-precision tensor holds NaN/Inf: counted before any
    FP8 cast, so no FP8 failure, and a sign that the layer's other statistics at that step are
    not to be trusted either (its output, so its gradient, is computed from the same numbers).
    In the order the step cast them (`rules.cast_place`), the tensor they began in first; the
    layers' forward order is fp8_stats' rows' (`table`)."""
    layers = list(dict.fromkeys(layer for layer, _ in table))
    tensors = known_first(dict.fromkeys(tensor for _, tensor in table), TENSORS)
    return sorted((key for key, stats in table.items() if nonfinite(stats)),
                  key=cast_place(layers, tensors))


NAMED_LAYERS = 4  # layers named in a line, the others counted


def named_layers(layers: list[str]) -> str:
    """The first NAMED_LAYERS of `layers`, the others counted: one line for a large model."""
    return ", ".join(layers[:NAMED_LAYERS]) + (
        f" and {len(layers) - NAMED_LAYERS} more" if len(layers) > NAMED_LAYERS else "")


def nonfinite_message(step: int, rows: Collection[tuple[str, str]]) -> str:
    """The line about the layers the guard does not judge, said once per layer: `rows` are the
    layers not named before (the callback remembers them), in cast order (`nonfinite_rows`):
    the layer a NaN began in is named first."""
    tensors = ", ".join(dict.fromkeys(tensor for _, tensor in rows))
    layers = list(dict.fromkeys(layer for layer, _ in rows))
    named = named_layers(layers)
    return (f"fp8_guard: at step {step}, {len(layers)} layer(s) newly hold NaN/Inf in their "
            f"high-precision {tensors}, before any FP8 cast: no FP8 failure, and running a layer "
            f"in high precision cannot fix it, so fp8_guard does not judge a layer at a logging "
            f"step where it holds NaN/Inf (here {named}; each layer is named once) and moves no "
            f"layer for them; "
            f"the layers without NaN/Inf are judged as usual. Look at where they first appear "
            f"(fp8/<tensor>/nonfinite; fp8_stats' warnings name the layers) and at the loss and "
            f"the batch at that step; change {NONFINITE_CHANGE}"
            + (NOT_CLIPPED if any(direction(tensor) == "backward" for _, tensor in rows)
               else ""))


class GuardStateError(RuntimeError):
    """A checkpoint's fp8_guard entry that cannot be read, under `strict: true`."""


class GuardBudgetError(RuntimeError):
    """More of the FP8 FLOPs would fall back than `max_fallback_share` allows (`strict: true`)."""


def thresholds(config: GuardConfig) -> Thresholds:
    """The tracker's limits: each logging step judged on its own (the guard counts the steps)."""
    return Thresholds(max_underflow_pct=config.max_underflow_pct,
                      max_overflow_pct=config.max_overflow_pct, min_cos_sim=config.min_cos_sim,
                      persist_steps=1, source="fp8_guard options")


@dataclass(frozen=True)
class Fallback:
    """One layer moved to high precision: from the step after `step` on."""

    layer: str
    step: int
    flops_share: float  # of the model's linear-GEMM FLOPs
    reasons: tuple[str, ...]  # the flags' messages
    numbers: dict[str, float] = field(default_factory=dict)  # `<tensor>/<stat>` at `step`
    flagged: tuple[str, ...] = ()  # `<tensor> <stat> <value> (<rule>)` per flag at `step`

    def record(self) -> dict[str, Any]:
        """As JSON data that compares equal to itself read back: lists, and NaN/Inf as strings
        (W&B and MLflow refuse a hyperparameter logged again with an unequal value)."""
        return {**asdict(self), "reasons": list(self.reasons), "flagged": list(self.flagged),
                "numbers": _plain(self.numbers)}

    @classmethod
    def from_dict(cls, item: Mapping[str, Any]) -> Fallback:
        """From `asdict` (a checkpoint) or `record` (a logged hyperparameter); ValueError or
        TypeError for anything else (`_fields`)."""
        return cls(**_fields(item, layer=_text, step=_integer, flops_share=_number,
                             reasons=_texts, flagged=_texts, numbers=_numbers))


@dataclass(frozen=True)
class Repromotion:
    """One layer in fallback back in FP8: from the step after `step` on."""

    layer: str
    step: int
    fallen_at: int  # the step of the fallback it ends
    healthy_steps: int  # what-if logging steps in a row within the limits
    numbers: dict[str, float] = field(default_factory=dict)  # what-if `<tensor>/<stat>` at `step`

    def record(self) -> dict[str, Any]:
        """As JSON data that compares equal to itself read back (see `Fallback.record`)."""
        return {**asdict(self), "numbers": _plain(self.numbers)}

    @classmethod
    def from_dict(cls, item: Mapping[str, Any]) -> Repromotion:
        """As `Fallback.from_dict`."""
        return cls(**_fields(item, layer=_text, step=_integer, fallen_at=_integer,
                             healthy_steps=_integer, numbers=_numbers))


@dataclass(frozen=True)
class Summary:
    """A layer's fallback/re-promotion pairs older than its last `KEPT_DECISIONS`, counted."""

    layer: str
    step: int  # the last counted re-promotion's
    pairs: int
    first_step: int  # the first counted fallback's

    def record(self) -> dict[str, Any]:
        """As JSON data (every field plain)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, item: Mapping[str, Any]) -> Summary:
        """As `Fallback.from_dict`."""
        return cls(**_fields(item, layer=_text, step=_integer, pairs=_integer,
                             first_step=_integer))


@dataclass(frozen=True)
class Refusal:
    """A layer that would have fallen back at `step` but `max_fallback_share` kept in FP8."""

    layer: str
    step: int
    flops_share: float  # of the model's linear-GEMM FLOPs
    fallback_share: float  # of the FP8 FLOPs at the start, in high precision had it fallen back
    max_fallback_share: float  # the budget then

    def record(self) -> dict[str, Any]:
        """As JSON data (every field plain and finite)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, item: Mapping[str, Any]) -> Refusal:
        """As `Fallback.from_dict`."""
        return cls(**_fields(item, layer=_text, step=_integer, flops_share=_number,
                             fallback_share=_number, max_fallback_share=_number))


@dataclass
class Verdict:
    """What one logging step decided."""

    fallbacks: list[Fallback]
    refused: list[str]  # candidates the budget kept in FP8
    budget_message: str | None  # set when a candidate was refused


Rows = dict[tuple[str, str], dict[str, float]]


def _last_rows(recent: list[tuple[int, Rows, Rows]], keep: int) -> list[tuple[int, Rows, Rows]]:
    """`recent` (oldest first) less all but each (layer, tensor)'s last `keep` rows per table,
    and less the steps left without a row: a layer unjudged at the last steps (NaN/Inf) keeps
    the rows its streaks rest on, so a resume replays them exactly."""
    later: tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]] = ({}, {})
    kept = []
    for step, *tables in reversed(recent):
        judged, fallen = ({key: stats for key, stats in table.items() if seen.get(key, 0) < keep}
                          for table, seen in zip(tables, later, strict=True))
        for table, seen in zip(tables, later, strict=True):
            for key in table:
                seen[key] = seen.get(key, 0) + 1
        if judged or fallen:
            kept.append((step, judged, fallen))
    return kept[::-1]


class GuardCore:
    """Judges each logging step's table and records the fallbacks.

    `flops` gives each FP8 layer (by the tables' layer names), in model order, its share of the
    model's linear GEMM FLOPs; only those layers are judged. Two calls per logging step, so that
    ranks can agree in between: `candidates` (this rank's view) then `decide` (with the union
    over ranks).
    """

    def __init__(self, config: GuardConfig, flops: Mapping[str, float],
                 blocks: Iterable[int] = ()):
        self.config = config
        # te_swap's block numbers of the whole model (`health.rules.model_blocks`) and the
        # margin the delayed FP8 layers cast with (fp8_stats' `CastMode.margin`, set by the
        # callback at each logging step): the fallback reasons' keep_*_blocks and margin advice
        # follow te_swap's counts and the run's recipe, as fp8_stats' own advice does
        self.blocks = frozenset(blocks)
        self.margin = 0
        # and the longest amax history they scale from (`CastMode.history_len`; None: not
        # known): a stale-scale underflow lasting no longer than it moves no layer
        self.history_len: int | None = None
        # the first step of each tensor's current run of stale-scale-only flags
        self._stale_since: dict[tuple[str, str], int] = {}
        self.flops = dict(flops)
        self.initial_share = sum(self.flops.values())
        self.fallbacks: dict[str, Fallback] = {}
        self.repromotions: list[Repromotion] = []
        self.ended: list[Fallback] = []  # the fallbacks the re-promotions ended
        self.summaries: dict[str, Summary] = {}  # each layer's pairs older than the kept ones
        # the logged keys the folded records and superseded summaries held: W&B and MLflow keep
        # them and refuse another value under one, so no later record gets one (`_fold`)
        self._retired: set[str] = set()
        self.refusals: dict[str, Refusal] = {}  # each layer's first refusal by the budget
        self.warned: set[str] = set()
        self._tracker = self._judge()
        self._whatif = HealthTracker(thresholds(config), keep_flags=False)  # the layers in fallback
        # the last judged rows, each (layer, tensor)'s last few per tracker (`_last_rows`):
        # (step, layers in FP8, layers in fallback)
        self._recent: list[tuple[int, Rows, Rows]] = []
        self._flags: dict[str, list[Flag]] = {}
        self.nonfinite: list[tuple[str, str]] = []  # the rows with NaN/Inf at the last step
        # fallbacks decided before the run's steps restarted (`fit(reset_time=True)`): every
        # step now is after them, whatever its number
        self._before_reset: set[str] = set()

    def _judge(self) -> HealthTracker:
        """A fresh tracker of the layers in FP8, whose flags' changes are the fallback reasons."""
        return HealthTracker(thresholds(self.config), keep_flags=False, blocks=set(self.blocks))

    @property
    def layers(self) -> list[str]:
        """The judged layers in a fixed order (the same on every rank)."""
        return sorted(self.flops)

    @property
    def held(self) -> list[str]:
        """The fallbacks this guard holds in high precision: those of its judged layers. A
        checkpoint's fallback of a layer this run does not run in FP8 (te_swap's `exclude`
        given it, as the fallback's own advice says) is history: counted in neither FLOPs
        share (it was, twice: the series read 0 % in FP8 and the budget was spent) and never
        re-promoted (its what-if rows would have put it "in FP8 again" while te_swap kept it
        out)."""
        return [layer for layer in self.fallbacks if layer in self.flops]

    @property
    def fp8_flops_share(self) -> float:
        """Share of the model's linear-GEMM FLOPs that runs in FP8 now."""
        return self.initial_share - sum(self.fallbacks[layer].flops_share for layer in self.held)

    @property
    def fallback_share(self) -> float:
        """Share of the FLOPs that ran in FP8 at the start that now falls back."""
        if not self.initial_share:
            return 0.0
        return sum(self.fallbacks[layer].flops_share for layer in self.held) / self.initial_share

    def candidates(self, step: int, table: Table) -> list[str]:
        """The layers still in FP8 with a tensor flagged at this and the `consecutive - 1`
        judged logging steps before it (with one-step rules, flagged = bad: the tracker's
        streak). A layer with NaN/Inf in any row (`nonfinite`) is not judged at this step: its
        streaks neither grow nor reset, as at delayed scaling's first cast, and the rule that
        flags NaN/Inf never moves a layer; the other layers are judged. A tensor flagged only
        for a stale scale (`underflow_stale`) moves its layer only once that has lasted longer
        than the amax history (`_transient`)."""
        self.nonfinite = nonfinite_rows(table)
        blind = {layer for layer, _ in self.nonfinite}
        judged = {key: dict(stats) for key, stats in table.items()
                  if key[0] in self.flops and key[0] not in blind | self.fallbacks.keys()}
        held = set(self.held)
        fallen = {key: dict(stats) for key, stats in table.items()
                  if key[0] in held and key[0] not in blind}
        # the streaks need `consecutive` (or `repromote_after`) steps, the rising-underflow rule
        # two
        keep = max(self.config.consecutive, 2, self.config.repromote_after or 0)
        if self._recent and step < self._recent[-1][0]:  # the steps restarted
            self._before_reset.update(self.fallbacks)
            self._stale_since.clear()  # its runs are counted again from here
        if judged or fallen:
            self._recent = _last_rows([*self._recent, (step, judged, fallen)], keep)
        self._whatif.update(step, fallen)
        self._tracker.margin, self._tracker.history_len = self.margin, self.history_len
        raised = self._judge_fp8(step, judged)
        self._flags = {}
        for (layer, _), flags in raised.items():
            self._flags.setdefault(layer, []).extend(flags)
        return sorted({layer for (layer, tensor), flags in raised.items()
                       if self._tracker.streak(layer, tensor) >= self.config.consecutive
                       and not self._transient(step, (layer, tensor))})

    def _judge_fp8(self, step: int, judged: Table) -> dict[tuple[str, str], list[Flag]]:
        """The tracker's flags of the layers in FP8 at this step, noting each tensor's run of
        stale-scale-only flags (`_transient`)."""
        raised = self._tracker.update(step, judged)
        for key in judged:
            if {flag.rule for flag in raised.get(key, ())} == {"underflow_stale"}:
                self._stale_since.setdefault(key, step)
            else:
                self._stale_since.pop(key, None)
        return raised

    def _transient(self, step: int, key: tuple[str, str]) -> bool:
        """Whether this tensor's flag at `step` is a stale scale that delayed scaling's own
        amax history may still fix: every flag of its run of stale-scale-only steps within
        `history_len` steps of the first. The spike that left the scale stale came at or
        before that first step, and a delayed scale is taken from the last `history_len`
        amaxes, so after them the spike is gone (TE 2.x pytorch/quantization.py, the amax
        history's roll); a stale scale lasting longer has fresh spikes behind it, an amax that
        swings past FP8's range within the window: a range problem the guard moves. Unknown
        history (None): not transient, as before."""
        since = self._stale_since.get(key)
        return since is not None and self.history_len is not None \
            and step - since <= self.history_len

    def ready(self, step: int, table: Table) -> list[str]:
        """Layers in fallback whose every what-if tensor in `table` (this step's) has been
        within the limits at `repromote_after` logging steps in a row; none when off, and not
        one holding NaN/Inf at this step (`candidates` left it unjudged)."""
        after = self.config.repromote_after
        if after is None:
            return []
        blind, held = {layer for layer, _ in self.nonfinite}, set(self.held)
        tensors: dict[str, list[str]] = {}
        for layer, tensor in table:
            if layer in held and layer not in blind and (layer in self._before_reset
                                            or self.fallbacks[layer].step < step):
                tensors.setdefault(layer, []).append(tensor)
        return sorted(layer for layer, names in tensors.items()
                      if all(self._whatif.streak(layer, t, bad=False) >= after for t in names))

    def repromote(self, step: int, layers: Iterable[str], table: Table) -> list[Repromotion]:
        """Put `layers` (ready on every rank) back in FP8; their streaks start afresh."""
        done = []
        for layer in sorted(set(layers) & set(self.fallbacks)):
            fallback = self.fallbacks.pop(layer)
            self.ended.append(fallback)
            numbers = {f"{tensor}/{stat}": float(value)
                       for (name, tensor), stats in table.items() if name == layer
                       for stat, value in stats.items()}
            done.append(Repromotion(layer, step, fallback.step,
                                    self.config.repromote_after or 0, numbers))
            self.repromotions.append(done[-1])
            self._forget(layer)
            self._fold(layer)
            self._recent = [(s, {k: v for k, v in judged.items() if k[0] != layer},
                             {k: v for k, v in fallen.items() if k[0] != layer})
                            for s, judged, fallen in self._recent]
        return done

    def _fold(self, layer: str) -> None:
        """Count `layer`'s oldest pairs into its `Summary`, past its last KEPT_DECISIONS."""
        ended = [f for f in self.ended if f.layer == layer]
        for oldest in ended[:max(len(ended) - KEPT_DECISIONS, 0)]:
            back = next(r for r in self.repromotions
                        if r.layer == layer and r.fallen_at == oldest.step)
            held = {id(record): key for key, record in self._keyed()}
            # only the keys given to loggers (`_unlogged`): no logger holds the others, and
            # retiring them too grew the checkpoint and the memory by three keys a pair
            unlogged = self._unlogged()
            self._retired |= {held[id(record)] for record in (oldest, back,
                                                                self.summaries.get(layer))
                              if record is not None and id(record) not in unlogged}
            self.ended.remove(oldest)
            self.repromotions.remove(back)
            before = self.summaries.get(layer)
            self.summaries[layer] = Summary(layer, back.step, 1 + (before.pairs if before else 0),
                                            before.first_step if before else oldest.step)

    def _forget(self, layer: str) -> None:
        self._before_reset.discard(layer)
        for key in [k for k in self._stale_since if k[0] == layer]:
            del self._stale_since[key]
        self._tracker.forget(layer)
        self._whatif.forget(layer)

    def decide(self, step: int, layers: Iterable[str], table: Table) -> Verdict:
        """Fall back `layers` (every rank's candidates) while the budget allows, the smallest
        FLOPs share first, ties in model order: each has been bad at `consecutive` logging steps
        in a row, the guard's one measure of trouble, so the budget moves as many of them as it
        holds (and, like the order, the shares are the same on every rank)."""
        verdict = Verdict([], [], None)
        wanted = set(layers) - set(self.fallbacks)
        for layer in sorted((name for name in self.flops if name in wanted),
                            key=self.flops.__getitem__):
            share = self.flops[layer]
            after = self.fallback_share + (share / self.initial_share if self.initial_share else 0)
            if after > self.config.max_fallback_share + 1e-12:
                verdict.refused.append(layer)
                self.refusals.setdefault(layer, Refusal(layer, step, share, after,
                                                        self.config.max_fallback_share))
                continue
            reasons = tuple(f.message for f in self._flags.get(layer, ()))
            numbers = {f"{tensor}/{stat}": float(value)
                       for (name, tensor), stats in table.items() if name == layer
                       for stat, value in stats.items()}
            flagged = tuple(f"{f.tensor} {f.reading}" for f in self._flags.get(layer, ()))
            fallback = Fallback(layer, step, share, reasons or ("flagged on another rank",),
                                numbers, flagged)
            self.fallbacks[layer] = fallback
            verdict.fallbacks.append(fallback)
        if verdict.refused:
            verdict.budget_message = self._over_budget(step, verdict.refused)
        return verdict

    def in_fallback(self) -> dict[str, float]:
        """`IN_FALLBACK_PREFIX<layer>` of each layer moved in this run (or before, in the
        checkpoint): 1 in fallback, 0 back in FP8; a few keys, logged at each logging step."""
        moved = {f.layer for f in self.ended} | self.summaries.keys() | self.fallbacks.keys()
        return {IN_FALLBACK_PREFIX + layer: float(layer in self.fallbacks)
                for layer in sorted(moved)}

    def records(self) -> dict[str, dict[str, Any]]:
        """The hyperparameters to log: each refusal and a layer's first `KEPT_DECISIONS`
        fallback/re-promotion pairs kept, and each layer's `Summary` of older pairs under
        `OLDER_PREFIX<layer>.ba<step>` where it counts a power of 2 (`_unlogged`), in
        step order: a layer's first of each kind under `<prefix><layer>` (none after a summary:
        that key held the counted one), later ones under `<prefix><layer>.ba<step>`, a refusal only its first (a logged value must never change;
        MLflow refuses `@` in a key and `/` below a key it holds, dropping the whole queued batch
        with it). The sort is stable: one step's events keep the order they came in; after a fit
        restarted the steps (`reset_time`) both fits' events interleave by step number."""
        unlogged = self._unlogged()
        return {key: record.record() for key, record in self._keyed()
                if id(record) not in unlogged}

    def _unlogged(self) -> set[int]:
        """The ids of the kept records past their layer's first KEPT_DECISIONS pairs, and of the
        summaries not at a power of 2 pairs: their keys are given as the others' (never retired:
        no logger holds them), so what is logged never changes, but a layer flipping all run logs a number of keys
        that grows with the log of its pairs (`IN_FALLBACK_PREFIX` has every span's steps)."""
        unlogged = {id(s) for s in self.summaries.values() if s.pairs & (s.pairs - 1)}
        for layer in {f.layer for f in self.ended} | self.fallbacks.keys():
            folded = self.summaries[layer].pairs if layer in self.summaries else 0
            fell = [f for f in self.ended if f.layer == layer]  # in the order decided
            fell += [self.fallbacks[layer]] if layer in self.fallbacks else []
            back = [r for r in self.repromotions if r.layer == layer]
            for decisions in (fell, back):
                unlogged |= {id(d) for d in decisions[max(KEPT_DECISIONS - folded, 0):]}
        return unlogged

    def _keyed(self) -> list[tuple[str, Fallback | Repromotion | Refusal | Summary]]:
        """`records`' keys and what they hold, in step order; a retired key is never given."""
        events = ([(f.step, FALLBACK_PREFIX, f.layer, f)
                   for f in [*self.ended, *self.fallbacks.values()]]
                  + [(r.step, REPROMOTION_PREFIX, r.layer, r) for r in self.repromotions]
                  + [(r.step, REFUSED_PREFIX, r.layer, r) for r in self.refusals.values()])
        keyed: list[tuple[int, str, Fallback | Repromotion | Refusal | Summary]] = []
        taken = set(self._retired) | {prefix + layer for layer in self.summaries
                                      for prefix in (FALLBACK_PREFIX, REPROMOTION_PREFIX)}
        for s in self.summaries.values():
            keyed.append((s.step, _untaken(f"{OLDER_PREFIX}{s.layer}.ba{s.step}", taken), s))
        for step, prefix, layer, record in events:  # a layer's events in the order they came
            base = prefix + layer
            keyed.append((step, _untaken(f"{base}.ba{step}" if base in taken else base, taken),
                          record))
        return [(key, record) for _, key, record in sorted(keyed, key=lambda e: e[0])]

    def _over_budget(self, step: int, refused: list[str]) -> str:
        wanted = sum(self.flops[layer] for layer in refused) / (self.initial_share or 1)
        kept = ", ".join(self.fallbacks) or "none"
        # most layers out: a budget that held them all would leave (nearly) no FP8 to run
        whole = whole_run([*self.held, *self.refusals], self.flops,
                          "are held in high precision or refused by the budget")
        return (f"fp8_guard: at step {step}, {', '.join(refused)} would also fall back, putting "
                f"{100 * (self.fallback_share + wanted):.1f} % of the FP8 FLOPs in high precision,"
                f" over {OPTION}.max_fallback_share = {100 * self.config.max_fallback_share:g} %"
                f" (already in fallback: {kept}). " + (whole or (
                    f"FP8 is not working for this model: check the recipe and the learning "
                    f"rate, or raise {OPTION}.max_fallback_share")))

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the fallbacks and the tables the tracker's streaks depend on."""
        def rows(t: Mapping[tuple[str, str], Mapping[str, float]]) -> list[list[Any]]:
            return [[layer, tensor, dict(stats)] for (layer, tensor), stats in t.items()]

        return {
            "fallbacks": [asdict(f) for f in self.fallbacks.values()],
            "repromotions": [asdict(r) for r in self.repromotions],
            "ended": [asdict(f) for f in self.ended],
            "summaries": [asdict(s) for s in self.summaries.values()],
            "refusals": [asdict(r) for r in self.refusals.values()],
            "recent": [(step, rows(judged), rows(fallen)) for step, judged, fallen in self._recent],
            "warned": sorted(self.warned),
            "before_reset": sorted(self._before_reset),
            "retired": sorted(self._retired),
            # the runs' first steps may be older than the kept rows
            "stale_since": [[layer, tensor, step]
                            for (layer, tensor), step in sorted(self._stale_since.items())],
            # `repromote` drops a layer's rows up to its re-promotion: nothing to forget on load
            REPROMOTED_ROWS_DROPPED: True,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the fallbacks and re-promotions, and the streaks by replaying the recent
        tables. A re-promoted layer's rows up to its re-promotion are not in them (`repromote`
        drops them), so its streaks start afresh there, as in the run; a checkpoint saved before
        that (without REPROMOTED_ROWS_DROPPED) forgets the layer at the row of its re-promotion's
        step number instead, which after `reset_time` can be a later fit's row."""
        self.fallbacks = {}
        for item in state.get("fallbacks", ()):
            fallback = Fallback.from_dict(item)
            self.fallbacks[fallback.layer] = fallback
        self.repromotions = [Repromotion.from_dict(r) for r in state.get("repromotions", ())]
        self.ended = [Fallback.from_dict(f) for f in state.get("ended", ())]
        self.summaries = {s.layer: s for s in map(Summary.from_dict, state.get("summaries", ()))}
        self.refusals = {r.layer: r for r in map(Refusal.from_dict, state.get("refusals", ()))}
        self.warned = set(state.get("warned", ()))
        self._retired = set(_texts(state.get("retired", ())))
        self._tracker = self._judge()
        self._whatif = HealthTracker(thresholds(self.config), keep_flags=False)
        self._recent = []
        self._stale_since = {}
        dropped = bool(state.get(REPROMOTED_ROWS_DROPPED))
        for step, judged, *fallen in state.get("recent", ()):
            tables = [{(layer, tensor): dict(stats) for layer, tensor, stats in rows}
                      for rows in (judged, *fallen[:1])]
            self._recent.append((step, tables[0], tables[1] if len(tables) > 1 else {}))
            self._whatif.update(step, self._recent[-1][2])
            self._judge_fp8(step, tables[0])
            for repromoted in () if dropped else self.repromotions:
                if repromoted.step == step:
                    self._forget(repromoted.layer)
        self._before_reset = set(_texts(state.get("before_reset", ()))) & self.fallbacks.keys()
        if "stale_since" in state:  # else (an earlier version's) as the replayed rows give them
            self._stale_since = {(_text(layer), _text(tensor)): _integer(step)
                                 for layer, tensor, step in state["stale_since"]}


#: The share of a run's FP8 layers from which no exclude (nor a larger fallback budget) is
#: advised, live (fp8_guard) and in `foundry-fp8 report` alike: trouble on that many layers is
#: FP8 failing for the whole run, not at a layer, and their exclude leaves (nearly) no layer in
#: FP8 (none: te_swap converts none, fp8_lint's FP8034 stops the run).
WHOLE_RUN_SHARE = 0.75


def is_whole_run(out: Collection[str], fp8: Collection[str], count: int = 0) -> bool:
    """The rule of `whole_run`: the layers `out` are WHOLE_RUN_SHARE or more of the run's FP8
    layers (`fp8`, or `count` where more)."""
    total = max(len(set(fp8)), count)
    return bool(total) and len(set(out) & set(fp8)) >= WHOLE_RUN_SHARE * total


def whole_run(out: Collection[str], fp8: Collection[str], what: str, loss: str = "",
              count: int = 0) -> str | None:
    """Said instead of an exclude of the layers `out` where they are WHOLE_RUN_SHARE or more of
    the run's FP8 layers `fp8` (`what`: what they are), else None (and where `fp8` is empty: a
    caller that does not know them): what they have in common is the fix; `loss`, the loss's
    own divergence, is named first where a caller knows it. `count`: the run's FP8 layers where
    more than `fp8` names (a report of an fp8_stats that watched some of them only)."""
    if not is_whole_run(out, fp8, count):
        return None
    n, total = len(set(out) & set(fp8)), max(len(set(fp8)), count)
    left = (f"only {plural(total - n, 'layer')} in FP8" if n < total else
            "no layer in FP8 (te_swap then converts none and fp8_lint's FP8034 stops the run)")
    return (f"FP8 is not working for this run as a whole: {n} of its {total} FP8 layers {what}, "
            f"and an exclude of them would leave {left}, so none is given. Look at what they "
            f"share: {loss}the learning rate, te_swap's recipe (`{SWAP}.fp8_recipe`: a shorter "
            "`amax_history_len`, a `margin`, or `scaling: current`), fp8_stats' thresholds "
            "(stricter than FP8 holds?), or train without te_swap.")


def exclude_regex(layers: Iterable[str], existing: str | None = None) -> str:
    """te_swap's `exclude` that keeps `layers` (names in the keys) and what `existing` excluded
    in high precision, and no other layer (`layers_regex`)."""
    pattern = layers_regex(layers)
    return f"(?:{existing})|{pattern}" if existing else pattern


def static_yaml(layers: Iterable[str], existing: str | None = None) -> str:
    """The YAML that runs the same layers in high precision from the start."""
    pattern = exclude_regex(layers, existing).replace("'", "''")
    return f"algorithms: {{te_swap: {{exclude: '{pattern}'}}}}"


def repromotion_message(repromoted: Repromotion) -> str:
    """The one log line of a re-promotion."""
    return (f"fp8_guard: layer '{repromoted.layer}' runs in FP8 again from step "
            f"{repromoted.step + 1} on, with a fresh delayed-scaling state: its what-if FP8 "
            f"statistics were within the limits at {repromoted.healthy_steps} logging steps in a "
            f"row up to step {repromoted.step} (in high precision since step "
            f"{repromoted.fallen_at + 1})")


def fallback_message(fallback: Fallback, yaml: str) -> str:
    """The one log line of a fallback."""
    return (f"fp8_guard: layer '{fallback.layer}' runs in high precision from step "
            f"{fallback.step + 1} on ({100 * fallback.flops_share:.1f} % of the linear FLOPs), "
            f"flagged at step {fallback.step}: {' | '.join(fallback.reasons)}. To run it so from "
            f"the start next time: {yaml}")


def render_fallbacks(fallbacks: Iterable[Fallback], fp8_share: float | None,
                     repromotions: Iterable[Repromotion] = ()) -> str:
    """Table of the fallbacks (markdown), those a re-promotion ended included, in step order:
    the fit-end print and `foundry-fp8 report`'s."""
    back = {(r.layer, r.fallen_at): r.step + 1 for r in repromotions}
    rows = ["| layer | from step | until | FLOPs share | flagged for |", "|---|---|---|---|---|"]
    for f in sorted(fallbacks, key=lambda f: (f.step, f.layer)):
        until = back.get((f.layer, f.step))
        rows.append(f"| {md_escape(f.layer)} | {f.step + 1} | "
                    f"{'the end' if until is None else f'step {until} (back in FP8)'} | "
                    f"{100 * f.flops_share:.1f} % | "
                    f"{md_escape('; '.join(f.flagged or f.reasons))} |")
    if fp8_share is not None:
        rows.append(f"\nFP8 share of the linear FLOPs now: {100 * fp8_share:.1f} %")
    return "\n".join(rows)


def _untaken(base: str, taken: set[str]) -> str:
    """`base`, or `base.2`, `base.3`, ... where taken (the same step in two fits), now taken."""
    key, again = base, 1
    while key in taken:
        again += 1
        key = f"{base}.{again}"
    taken.add(key)
    return key
