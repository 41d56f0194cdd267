"""FP8Monitor: per-layer FP8 health for any PyTorch training loop.

Watches the GEMM input (activation), weight and output gradient of selected linear layers
(`nn.Linear`, our EmulatedFP8Linear, TE's `Linear`/`LayerNormLinear`/`LayerNormMLP`) and reports
`tensor_stats` for each under the scale the tensor is (or would be) cast with:

- a module that runs delayed-scaling FP8 (EmulatedFP8Linear inside `fp8_autocast`, TE modules
  inside TE's autocast): the scale from its own `fp8_meta` read *before* the cast (forward
  pre-hook, a hook on the output's gradient), because TE and the emulation update scales when
  the autocast (forward) or the backward pass ends, so a scale read afterwards is the next step's;
- a module under current scaling: `fp8_max / amax` of the tensor itself;
- anything else (plain `nn.Linear`): the `recipe` what-if, current by default; `delayed` keeps
  an amax history recorded, amax only, on the batches before each logging step. So is the
  output gradient of a layer whose backward casts nothing (NVTE_BACKWARD_OVERRIDE), which is
  logged, marked `health.keys.UNCAST`, and never judged on its cast (`health.rules.UNCAST_JUDGED`).

Hooks exist only on logging steps (and, for a delayed what-if, on the recording batches before
them); a logging step pools its statistics across ranks with one all_reduce per reduction op and
moves them to the host in one transfer. A weight the same on every rank that saw it (DDP's
replicas, FSDP's all-gathered weight) counts once, as TE's debug API, which does not reduce weight
statistics across ranks, counts it; different weights under one name (expert parallelism) add up.

Under several ranks the collectives must stay matched, so a failure on one rank (in a hook, in
`start_step`, in `finish_step`'s own work, or one handed to `fail()`) does not stop that rank: it
keeps joining each step's collectives, with no statistics of its own, and sets a flag carried by
the pooling's all_reduce SUM; at that logging step every rank raises FP8MonitorError together.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
from torch import nn

from foundry_fp8 import emulate
from foundry_fp8.filters import module_filter_fn
from foundry_fp8.fp8_meta import canonical_modules
from foundry_fp8.health import (
    INITIAL_SCALE,
    Flag,
    HealthTracker,
    Thresholds,
    WhatIf,
    badness,
    direction,
    layer_key,
    render_table,
    short_layer,
    summary_metrics,
)
from foundry_fp8.health.keys import HIGH_PRECISION, SUMMARIES, UNCAST, summary_key
from foundry_fp8.health.rules import (
    DelayedRecipe,
    cast_order,
    judged_table,
    model_blocks,
    uncast_stats,
)
from foundry_fp8.jsonl import set_plain_mode
from foundry_fp8.numerics import (
    FP8_MAX,
    MAX_KEYS,
    STAT_KEYS,
    SUFFICIENT_INDEX,
    SUM_KEYS,
    all_reduce_sufficient_stats,
    delayed_scale_update,
    empty_sufficient_stats,
    finalize_stats,
    nonfinite_seen,
    pool_sufficient_stats,
    sufficient_stats,
)
from foundry_fp8.numerics import amax as te_amax
from foundry_fp8.options import MonitorConfig, Schedule
from foundry_fp8.paths import DUMP_FILE
from foundry_fp8.recipe import RecipeError
from foundry_fp8.swap import attention_out_projs, conv1d_features
from foundry_fp8.te import probe

#: The `about` line of a dump file's metadata; its `tensors` entry says per key which layer
#: (the metric keys' short name), FP8 format and kind of scale.
DUMP_ABOUT = ("<module>/<tensor>: the high-precision tensor the GEMM of module <module> took "
              "(first micro-batch; <module> is the full module name that layers and "
              "dump_layers are searched in, tensors[key].layer the metric keys' shorter one); "
              "<module>/<tensor>/scale: its FP8 scale (FP8 value = tensor * scale, saturated to "
              "the format's max)")

#: What tells one weight seen on several ranks from different weights under one name: equal
#: sums of squares (the same tensor; up to a reduction's rounding, `_SAME_WEIGHT_RTOL`) and equal
#: NaN and Inf counts.
_FINGERPRINT = ("x_sq", "nan_count", "inf_count")
_SAME_WEIGHT_RTOL = 1e-9

#: A row's NaN and Inf counts: without micro-batch boundaries (`next_microbatch`), those of the
#: tensor's first sighting in the step, at least 1 where a later sighting held any
#: (`nonfinite_seen`: one cheap read, not a count).
_NONFINITE = slice(SUFFICIENT_INDEX["nan_count"], SUFFICIENT_INDEX["inf_count"] + 1)
#: New flags of one rule at one logging step up to which each gets its own warning; beyond, one
#: warning per rule names them all (a diverging run breaks a rule in every layer at once: an
#: MPT-1B's 288 layer tensors would be 288 warnings, burying the first cause). NaN/Inf first.
GROUP_EACH = 3
#: The layer tensors that one warning names, at most (the per-layer series hold the rest).
GROUP_NAMED = 12


class FP8MonitorError(RuntimeError):
    """The monitor failed on this rank or another (raised on every rank at the same logging
    step); training itself is unaffected."""


@dataclass(frozen=True)
class Watch:
    """A tensor a module hook sees: its metric name, which `tensors:` kind selects it, where it
    comes from (`input`, a weight attribute, `grad_output`) and its slot in the module's
    `fp8_meta` scale (None: not known for this module)."""

    name: str
    kind: str
    source: str
    slot: int | None

    @property
    def direction(self) -> Literal["forward", "backward"]:
        return direction(self.kind)


LINEAR_WATCHES = (Watch("activation", "activation", "input", emulate.FWD_INPUT),
                  Watch("weight", "weight", "weight", emulate.FWD_WEIGHT),
                  Watch("gradient", "gradient", "grad_output", emulate.BWD_GRAD_OUTPUT))
# TE's LayerNormLinear: the hook input is the pre-norm X, not the GEMM input (post-norm X, cast
# with scale slot 0), so no activation is reported; LayerNormMLP: only its weights and its output
# gradient (fc2's dY) are visible. Slots are TE's FP8FwdTensors/FP8BwdTensors.
TE_WATCHES = {
    "Linear": LINEAR_WATCHES,
    "LayerNormLinear": LINEAR_WATCHES[1:],
    "LayerNormMLP": (Watch("fc1_weight", "weight", "fc1_weight", probe.GEMM1_WEIGHT),
                     Watch("fc2_weight", "weight", "fc2_weight", probe.GEMM2_WEIGHT)),
}


def watches_for(module: nn.Module) -> tuple[Watch, ...] | None:
    """The tensors module hooks can see on `module`; None when it is not a watched layer."""
    name = probe.te_class_name(module)
    if name == "LayerNormMLP":
        return (*TE_WATCHES[name],
                Watch("gradient", "gradient", "grad_output", probe.ln_mlp_gradient_slot()))
    if name is not None:
        return TE_WATCHES[name]
    # transformers' Conv1D (GPT-2's linear layers, the weight [in, out]): a Linear's GEMM
    # operands, and per-tensor statistics ignore layout
    linear = isinstance(module, nn.Linear) or conv1d_features(module) is not None
    return LINEAR_WATCHES if linear else None


def select_layers(model: nn.Module, config: MonitorConfig) -> dict[str, nn.Module]:
    """The watched layers whose names match `layers` and not `exclude`, by their names without
    DDP's, FSDP's and activation checkpointing's wrapper segments: the same regexes and metric
    names with or without FSDP."""
    selected = module_filter_fn(config.PATH, config.layers, config.exclude)
    uncalled = attention_out_projs(model)  # no hook of theirs ever runs
    return {name: module for name, module in canonical_modules(model)
            if watches_for(module) is not None and id(module) not in uncalled
            and selected(module, name)}


def dump_layers_of(layers: Collection[str], config: MonitorConfig) -> frozenset[str]:
    """The watched layers whose tensors a dump saves: `dump_layers` searched in the same full
    module names as `layers` (`select_layers`)."""
    chosen = module_filter_fn(config.PATH, config.dump_layers, None, include_key="dump_layers")
    return frozenset(name for name in layers if chosen(None, name))


def no_dump_layers_message(model: nn.Module, layers: Collection[str], config: MonitorConfig,
                           dump_steps: Collection[int]) -> str:
    """`dump_layers` selects none of the watched layers: the layers it would select that
    `layers`/`exclude` left out, and which option did (the regex is right, the watched set too
    narrow); else what it was searched in, with the metric keys' shorter names beside them when
    they differ (the ones a user copies). Patterns as the user wrote them (no repr's doubled
    backslashes, which a user would copy back into YAML)."""
    head = (f"{config.PATH}.dump_layers: '{config.dump_layers}' matches none of the "
            f"{len(layers)} watched layers, so dump_steps {sorted(dump_steps)} save nothing")
    unwatched = [name for name, module in canonical_modules(model)
                 if name not in layers and watches_for(module) is not None]
    wanted = dump_layers_of(unwatched, config)
    if wanted:
        in_layers = module_filter_fn(config.PATH, config.layers, None)
        by_option: dict[str, list[str]] = {}
        for name in (name for name in unwatched if name in wanted):  # in the model's order
            option = (f"exclude '{config.exclude}'" if in_layers(None, name)
                      else f"layers '{config.layers}'")
            by_option.setdefault(option, []).append(name)
        said = "; ".join(f"{_few(names)}, which {option} left out of the watched layers"
                         for option, names in by_option.items())
        return f"{head}: it matches {said} (fix: widen layers/exclude to watch them)"
    names = list(layers)[:3]  # in the model's order
    shorts = [short_layer(name) for name in names]
    keys = f" (the metric keys shorten them to {', '.join(shorts)})" if shorts != names else ""
    return (f"{head} (fix: a regex that re.search finds in their full module names, as layers "
            f"is: {_few(list(layers))}{keys})")


def _few(names: list[str]) -> str:
    """The first 3 of `names`, and `...` for the rest."""
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def thresholds_of(config: MonitorConfig) -> Thresholds:
    """The flagging limits a monitor warns with."""
    return Thresholds(max_underflow_pct=config.max_underflow_pct,
                      max_overflow_pct=config.max_overflow_pct, min_cos_sim=config.min_cos_sim)


class NoLayersError(ValueError):
    """`layers`/`exclude` select no layer: the statistics would silently be empty."""


def no_layers_message(model: nn.Module, config: MonitorConfig) -> str:
    """One line as an `OptionError` reads (`callbacks.fp8_stats.layers: ... (fix: ...)`): the
    regexes, how many linear layers there are, a few of their names as the regex sees them."""
    names = [name for name, module in canonical_modules(model) if watches_for(module) is not None]
    what = f"{config.layers!r}" + (f" minus exclude {config.exclude!r}" if config.exclude else "")
    key = f"{MonitorConfig.PATH}.layers"
    if not names:
        return f"{key}: {what}: the model has no linear layer to watch (fix: remove fp8_stats)"
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return (f"{key}: {what} matches none of the model's {len(names)} linear layers (fix: a "
            f"regex that re.search finds in their names, e.g. {shown})")


@dataclass(frozen=True)
class CastMode:
    """How a module casts its GEMM inputs in this forward."""

    delayed: bool  # with the scale in its own fp8_meta (else current scaling)
    forward_fmt: str
    backward_fmt: str
    power_2: bool = False
    # NVTE_BACKWARD_OVERRIDE's value (`te.facts`): the backward casts nothing, dY stays as it is
    backward_override: str | None = None
    # the recipe's `margin`: delayed scaling divides the scale by 2**margin (TE 2.18
    # common/recipe/__init__.py:247), so the persistent-overflow advice raises it by one
    margin: int = 0
    # how many past amaxes the delayed scale is taken from (`DelayedRecipe.history_len`: 1 under
    # most_recent), which the stale-scale advice names; None where not known
    history_len: int | None = None

    def fmt(self, direction: str) -> str:
        return self.backward_fmt if direction == "backward" else self.forward_fmt

    def casts(self, direction: str) -> bool:
        """Whether the pass `direction` casts its GEMM inputs to FP8."""
        return direction != "backward" or self.backward_override is None


def _te_cast_mode() -> CastMode | None:
    formats = probe.active_cast_formats()
    if formats is None:
        return None
    # TE >= 2.15 reads the recipe's `backward_override` in each FP8 forward of a Linear or
    # LayerNormLinear (pytorch/module/linear.py:1606, layernorm_linear.py:147 at v2.15;
    # linear.py:1967 at main d0067d0) and then runs its backward with `fp8 = False`: no dY cast
    # (module/base.py:1313 at v2.15, `use_fp8_bwd`); an older TE's recipe has no such field
    recipe = probe.active_recipe()
    algo = getattr(recipe, "amax_compute_algo", None)  # TE's may be a callable: not known
    history = getattr(recipe, "amax_history_len", None)
    return CastMode(*formats, backward_override=getattr(recipe, "backward_override", None),
                    margin=int(getattr(recipe, "margin", 0)),
                    history_len=1 if algo == "most_recent" else
                    history if algo == "max" and isinstance(history, int) else None)


def cast_mode(module: nn.Module) -> CastMode | None:
    """How `module` casts in the forward about to run; None when it does not run in FP8."""
    if isinstance(module, emulate.EmulatedFP8Linear):
        recipe = emulate.active_recipe()
        if recipe is None:
            return None
        try:
            override = emulate.backward_override(recipe)
        except RecipeError:  # the layer's own forward stops the run with this one line
            override = None
        return CastMode(recipe.scaling == "delayed", recipe.format_for("forward"),
                        recipe.format_for("backward"), recipe.use_power_2_scales, override,
                        recipe.margin, DelayedRecipe.of(recipe).history_len)
    return _te_cast_mode() if probe.te_class_name(module) is not None else None


def cast_scale(module: nn.Module, watch: Watch
               ) -> tuple[torch.Tensor | float, torch.Tensor | bool]:
    """The delayed scale `module` will cast `watch`'s tensor with (read before the cast), and
    whether it is still the initial one (on the device, no host sync): no state yet (TE creates
    it, with scale 1, in its first FP8 forward), an amax history not yet sized
    (EmulatedFP8Linear before its first cast), or scale 1 with nothing recorded for this tensor
    yet (the backward of the first step: the forward has sized the history, not filled it)."""
    meta = getattr(module, "fp8_meta", None)
    key = "scaling_bwd" if watch.direction == "backward" else "scaling_fwd"
    state = meta[key] if meta is not None and key in meta else None
    scale = getattr(state, "scale", None)
    if scale is None or watch.slot is None or scale.numel() <= watch.slot:
        return 1.0, True  # a number, filled on the tensor's device: a host tensor's copy syncs
    history = getattr(state, "amax_history", None)
    current = scale.reshape(-1)[watch.slot]
    if history is None or history.dim() != 2 or history.shape[1] <= watch.slot:
        return current, history is not None and history.numel() == 0
    return current, (current == 1) & (history[:, watch.slot] == 0).all()


def _reuses_weight_cast(args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether an FP8 forward reads the weight cast kept by an earlier one: TE's
    `is_first_microbatch=False` (te.Linear, LayerNormLinear, LayerNormMLP: the argument after
    the input; TE 2.20 module/linear.py:1958-1961, base.py:792-890) and EmulatedFP8Linear's, which
    models it. That GEMM reads the weight as cast then, at that forward's scale, not the weight
    and scale of now: the weight is judged at a forward that casts it (one that finds no kept
    cast and casts is left out too: the hook cannot tell)."""
    flag = args[1] if len(args) > 1 else kwargs.get("is_first_microbatch")
    return flag is False


def _uncounted_worst(table: Mapping[tuple[str, str], Mapping[str, float]],
                     left_out: Collection[tuple[str, str]]) -> list[str]:
    """The `fp8/<tensor>/worst_<stat>` keys `summary_metrics` fills with its neutral default
    (1.0, 0.0) because no row of `table` counts for them at this step: each left out (a
    fallback), on delayed scaling's initial scale (step 0), uncast, or NaN there. Not logged: a
    missing point is the same on every sink, where 1.0 would read as a perfect cast."""
    counted: dict[str, set[str]] = {}
    for (layer, tensor), stats in table.items():
        seen = counted.setdefault(tensor, set())
        if (layer, tensor) not in left_out and not stats.get(INITIAL_SCALE):
            seen.update(stat for stat, value in stats.items() if value == value)
    return [summary_key(tensor, name) for tensor, stats in counted.items() for name in SUMMARIES
            if name.startswith("worst_") and name.removeprefix("worst_") not in stats]


def nonfinite_message(flags: Collection[Flag]) -> str:
    """One warning for the NaN/Inf flags of one logging step (`GROUP_EACH`): each layer
    tensor with its count (the first `GROUP_NAMED` of `flags`, given in `cast_order`: the
    tensor the NaN/Inf started in first), and the changes their own warnings would name."""
    step = min(flag.step for flag in flags)
    named = ", ".join(f"'{flag.layer}' {flag.tensor} ({flag.stat} {flag.value:.0f})"
                      for flag in list(flags)[:GROUP_NAMED])
    if len(flags) > GROUP_NAMED:
        named += (f", and {len(flags) - GROUP_NAMED} more (their fp8_nan_count/ and "
                  "fp8_inf_count/ series)")
    changes = "; ".join(dict.fromkeys(flag.yaml_key for flag in flags))
    cause = next(iter(flags)).cause
    return (f"FP8 NaN/Inf at step {step} in {len(flags)} layer tensors, before any FP8 cast: "
            f"{named}. Likely cause: {cause}. Change: {changes}")


def grouped_message(flags: list[Flag], first: str, whatif: Collection[tuple[str, str]],
                    changes: Collection[str]) -> str:
    """One warning for the new flags of one threshold rule at one logging step (more than
    `GROUP_EACH`): `first`, the own warning of the tensor cast first (`cast_order`: where the
    fault began), then the others with their readings (`whatif`: rows whose numbers are
    what-if), the worst of them and `changes`, what the others' own warnings would name beyond
    `first`'s."""
    def row(flag: Flag) -> str:
        what = " (what-if)" if (flag.layer, flag.tensor) in whatif else ""
        return f"'{flag.layer}' {flag.tensor}{what}: {flag.reading}"

    rest = flags[1:]
    named = "; ".join(row(flag) for flag in rest[:GROUP_NAMED])
    if len(rest) > GROUP_NAMED:
        named += f"; and {len(rest) - GROUP_NAMED} more (their fp8_{flags[0].stat}/ series)"
    worst = max(flags, key=lambda flag: badness(flag.stat, flag.value))
    more = f" Other changes they name: {'; '.join(changes)}" if changes else ""
    return (f"FP8 {flags[0].rule} at step {flags[0].step} in {len(flags)} layer tensors at once, "
            f"one warning for all; worst {row(worst)}. First cast: {first}. Also: {named}."
            + more)


def multi_rank() -> bool:
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


@dataclass
class _Step:
    """What one armed step collects."""

    step: int | None
    logging: bool
    recording: bool
    dumping: bool
    seen: set[int] = field(default_factory=set)  # rows seen in this micro-batch
    modes: dict[str, CastMode | None] = field(default_factory=dict)
    pending: dict[int, torch.Tensor] = field(default_factory=dict)
    # rows that may be cast with the initial delayed scale: whether they are (bool or 0-d device
    # tensor, read in the step's one host transfer)
    initial: dict[int, torch.Tensor | bool] = field(default_factory=dict)
    whatif: set[int] = field(default_factory=set)  # rows measured under the `recipe` what-if
    uncast: set[int] = field(default_factory=set)  # what-if rows of a layer in FP8 (no cast)
    formats: dict[int, str] = field(default_factory=dict)  # the FP8 format each row is cast in
    amax: torch.Tensor | None = None  # what-if amaxes of this step, one per row
    dump: dict[str, torch.Tensor] = field(default_factory=dict)
    dump_meta: dict[str, dict[str, str]] = field(default_factory=dict)  # per dumped key
    dump_bytes: int = 0
    left_out: dict[str, int] = field(default_factory=dict)  # keys past the cap: their bytes


#: Every monitor alive in this process, for `abort_unfinished`.
_monitors: weakref.WeakSet[FP8Monitor] = weakref.WeakSet()


def abort_unfinished() -> int:
    """Take the armed hooks of every monitor whose step never finished off its model, and
    return how many monitors had them. A fit that raised mid-step leaves its monitor armed, and
    an unclosed Trainer (LLM-Foundry's `train()` raises without closing it; a notebook's
    traceback keeps it alive) keeps that monitor: its hooks computed a dead step's statistics
    at every forward of the next run on the same model. Called where a fit starts, when no
    step of a live fit is armed."""
    stale = [monitor for monitor in list(_monitors) if monitor._handles]
    for monitor in stale:
        monitor.abort()
    return len(stale)


class _WeakHook:
    """A hook calling the monitor's `method(name, module, *hook args)` (through its `_guard`)
    by a weak reference.

    A forward's autograd graph keeps its backward hooks (torch's BackwardHook, reachable only
    from C++, where the garbage collector cannot follow), and a run's last graph lives on in
    Composer's `state.loss`/`state.outputs`; a strong hook closed the cycle graph -> monitor ->
    model -> `model.logger` -> State -> graph and kept the whole run alive. Once the monitor is
    gone the hook does nothing. A copy of the armed model (`torch.save(model)`, `deepcopy` for an
    EMA) gets an inert hook (`_Inert`): its forwards are not the watched model's."""

    def __init__(self, method: Callable[..., None], name: str):
        self._ref, self._name = weakref.WeakMethod(method), name

    def __call__(self, module: nn.Module, *args: Any) -> None:
        bound = self._ref()
        if bound is not None:
            bound.__self__._guard(bound, self._name, module, *args)

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return _Inert, ()


class _EagerHook(_WeakHook):
    """A forward hook: eager under torch.compile (Dynamo would recompile it for every layer
    shape)."""

    __call__ = torch.compiler.disable(_WeakHook.__call__)


class _GradHook:
    """A hook on a watched output's gradient, called as a full backward pre-hook would be; it
    holds the module weakly, as the autograd graph may outlive the model."""

    def __init__(self, hook: _WeakHook, module: nn.Module):
        self._hook, self._module = hook, weakref.ref(module)

    def __call__(self, grad: torch.Tensor) -> None:
        module = self._module()
        if module is not None:
            self._hook(module, (grad,))


class _Inert:
    """What a copied hook becomes."""

    def __call__(self, *args: Any) -> None:
        return None


class FP8Monitor:
    """Collects FP8 statistics on the steps you choose: `start_step(step)` ... `finish_step()`.

    `start_step()` without a step logs that step; with a step number, `schedule` decides (log,
    dump, or record amaxes for a delayed `recipe` what-if; default `Schedule()`: every 100
    steps, as fp8_stats). `finish_step()` returns the
    per-layer series `fp8_<stat>/<tensor>/<layer>` and the summary series `fp8/<tensor>/<name>`
    (`health.keys`; pooled over ranks, the same on every rank), judged by `self.tracker`.
    """

    def __init__(self, model: nn.Module, config: MonitorConfig | None = None,
                 on_warning: Callable[[str], None] | None = None,
                 schedule: Schedule | None = None,
                 passes: Callable[[Exception], bool] | None = None):
        self.model = model
        #: the errors a hook lets through to the forward or backward it runs in, where the
        #: caller can act on them (fp8_stats: out of memory under Composer's auto micro-batching,
        #: which runs the batch again smaller); any other error of a hook is kept for
        #: `finish_step`
        self.passes = passes or (lambda error: False)
        self.config = config or MonitorConfig()
        self.schedule = schedule or Schedule()
        if self.schedule.dump_steps and self.config.dump_folder is None:
            raise ValueError("fp8_stats.dump_steps: needs a dump_folder")
        self.layers = select_layers(model, self.config)
        if not self.layers:
            raise NoLayersError(no_layers_message(model, self.config))
        self.on_warning = on_warning or (lambda msg: warnings.warn(msg, stacklevel=2))
        self._watches = {name: tuple(w for w in watches_for(module) or ()
                                     if w.kind in self.config.tensors)
                         for name, module in self.layers.items()}
        self.rows = [(name, w.name) for name, ws in self._watches.items() for w in ws]
        self._weight_rows = torch.tensor([w.source not in ("input", "grad_output")
                                          for ws in self._watches.values() for w in ws])
        self._row = {key: i for i, key in enumerate(self.rows)}
        recipe = self.config.recipe
        self._whatif_fp8_max = torch.tensor(
            [FP8_MAX[recipe.format_for(w.direction)] for ws in self._watches.values() for w in ws])
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        _monitors.add(self)
        self._step: _Step | None = None
        self._history: torch.Tensor | None = None  # what-if delayed state [len, rows]
        self._scale: torch.Tensor | None = None
        self._folds = 0  # delayed what-if updates so far
        self.error: BaseException | None = None
        self._dump_failed = False  # warned once about a dump that could not be written
        # the dump files written, oldest first, with the number of tensors each holds
        self.dumped: list[tuple[Path, int]] = []
        self.dump_names = dump_layers_of(self.layers, self.config)
        if self.schedule.dump_steps and not self.dump_names:  # said at FIT_START, once
            self.on_warning(no_dump_layers_message(
                model, self.layers, self.config,
                self.schedule.dump_steps))  # type: ignore[arg-type]
        # the edge-block advice names te_swap's edges: the model's blocks as te_swap counts them
        # (swap.plan_swap: every name), not only the watched layers'
        # the what-if rows are judged with fp8_stats' own recipe (its margin: the stale-scale
        # rule), te_swap's layers with the margin they cast with (below)
        self.tracker = HealthTracker(thresholds_of(self.config), keep_flags=False,
                                     blocks=model_blocks(
                                         name for name, _ in model.named_modules(
                                             remove_duplicate=False)),
                                     whatif_recipe=DelayedRecipe.of(self.config.recipe))
        self.short = {name: short_layer(name) for name in self.layers}  # names in keys
        # the last logging step's statistics and flags, for listeners (the guard); empty on a
        # rank whose own work on them failed
        self.table: dict[tuple[str, str], dict[str, float]] = {}
        self.flags: dict[tuple[str, str], list[Flag]] = {}
        # `table` as the rules judged it, what listeners act on: the `uncast_rows` (tensors their
        # layer's FP8 run does not cast: its backward under NVTE_BACKWARD_OVERRIDE, and a
        # fallback layer's then) left out, or with NaN/Inf only their `uncast_stats`
        self.judged: dict[tuple[str, str], dict[str, float]] = {}
        self.uncast_rows: set[tuple[str, str]] = set()
        # NVTE_BACKWARD_OVERRIDE of the recipe the FP8 layers last ran under (`CastMode`), kept
        # while every layer is in fallback; `_seen_override`: some layer has run in FP8 since
        self._override: str | None = None
        self._seen_override = False
        # the last `finish_step` pooled over every rank: the same on all ranks, so listeners
        # that run collectives (the guard's vote) are called on every rank or on none
        self.pooled = False
        # the rows of `table` with what-if numbers (the layer did not cast in FP8), and those
        # of them that `finish_step`'s `fallbacks` left out of the summary series
        self.whatif_rows: set[tuple[str, str]] = set()
        self.fallback_rows: set[tuple[str, str]] = set()
        # the what-if rows of layers with no FP8 cast (te_swap's exclude, fp8_guard's fallback),
        # logged with the `HIGH_PRECISION` marker
        self.high_rows: set[tuple[str, str]] = set()
        # rows judged with what-if numbers at some logging step; and the worst values restored
        # from an earlier version's checkpoint, which kept not where they came from: `summary()`
        # marks those of them still the worst as what-if when their row is in `whatif_judged`
        self.whatif_judged: set[tuple[str, str]] = set()
        self._origin_unknown: dict[tuple[str, str], dict[str, float]] = {}
        # rows seen at logging steps only with delayed scaling's initial scale (no nonzero amax
        # recorded yet: a gradient that is always 0), so never judged: `summary()` names them
        self.initial_only: set[tuple[str, str]] = set()
        # the FP8 format (`E4M3`, `E5M2`) each row of `table` was cast in, or its what-if was
        self.formats: dict[tuple[str, str], str] = {}

    @property
    def record_window(self) -> int:
        """Batches before a logging step whose amaxes a delayed what-if needs (0: current)."""
        recipe = self.config.recipe
        if recipe.scaling != "delayed":
            return 0
        return 1 if recipe.amax_compute_algo == "most_recent" else recipe.amax_history_len

    @property
    def active(self) -> bool:
        return self._step is not None

    def _device(self) -> torch.device:
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    @property
    def dumping(self) -> bool:
        """Whether `finish_step` writes a dump of the armed step."""
        return self._step is not None and self._step.dumping

    def start_step(self, step: int | None = None) -> bool:
        """Arm hooks for this step if it logs, dumps or records; returns whether it does (after a
        failure on this rank, such a step arms nothing but still joins its collectives)."""
        self.abort()
        window = self.record_window
        logging = step is None or self.schedule.logs(step)
        recording = window > 0 and (logging or self.schedule.records(step, window))
        if not (logging or recording):
            return False
        dumping = (step is not None and logging and self.schedule.dumps(step)
                   and self.config.dump_folder is not None)
        self._step = _Step(step, logging, recording, dumping)
        if self.error is None:
            self._attempt(self._arm, recording)
        return True

    def next_microbatch(self) -> None:
        """A new micro-batch of the armed step starts (Composer's BEFORE_FORWARD): its inputs
        and output gradients are pooled into the step's statistics, as another rank's would be
        (a weight counts once a step: `_observe`). A sighting repeated within a micro-batch
        (activation recompute) is not counted again. Without these calls every sighting after a
        tensor's first in the step counts as a recompute."""
        if self._step is not None:
            self._step.seen.clear()

    def restart_batch(self) -> None:
        """The armed step's batch starts over (Composer's BEFORE_TRAIN_BATCH, again after an
        out-of-memory retry of `device_train_microbatch_size: auto`): what its failed attempt
        collected is dropped, the hooks stay."""
        step = self._step
        if step is not None:
            self._step = _Step(step.step, step.logging, step.recording, step.dumping)

    def _arm(self, recording: bool) -> None:
        if recording and self._history is None:
            self._init_whatif()
        for name, module in self.layers.items():
            if not self._watches[name]:
                continue
            self._handles.append(module.register_forward_pre_hook(
                _EagerHook(self._forward, name), with_kwargs=True))
            if any(w.kind == "gradient" for w in self._watches[name]):
                self._handles.append(module.register_forward_hook(
                    _EagerHook(self._hook_gradient, name)))

    def _init_whatif(self) -> None:
        """Fresh delayed state (history of zeros, scale 1), as TE starts. Never reset: the
        `record_window` batches before a logging step push older amaxes out of the history of
        every tensor seen on them (a slot whose amax is 0 neither rolls nor changes its scale, as
        in TE's update kernel)."""
        device = self._device()
        self._history = torch.zeros(self.config.recipe.amax_history_len, len(self.rows),
                                    device=device)
        self._scale = torch.ones(len(self.rows), device=device)
        self._whatif_fp8_max = self._whatif_fp8_max.to(device)

    def _guard(self, hook: Callable[..., None], *args: Any) -> None:
        """Our failure must not break the model's forward/backward: keep it for finish_step."""
        if self.error is not None or self._step is None:
            return
        try:
            hook(*args)
        except Exception as e:  # re-raised by finish_step, on every rank
            if self.passes(e):  # the step starts again (`restart_batch`) or the run ends
                raise
            self.error = e

    def _attempt(self, work: Callable[..., Any], *args: Any) -> Any:
        """This rank's own work in a step: on failure under several ranks, `fail()` and return
        None, so that the rank still joins the step's collectives; in a single process, raise."""
        try:
            return work(*args)
        except Exception as e:
            self.fail(e)
            if not multi_rank():
                raise
            return None

    def _forward(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (module.training or torch.is_grad_enabled()):
            return  # an evaluation inside the step's window (a plain loop's): not training's
        step = self._step
        assert step is not None
        if name not in step.modes:  # the first forward (not an activation recompute) decides
            step.modes[name] = cast_mode(module)
        reused = step.modes[name] is not None and _reuses_weight_cast(args, kwargs)
        for watch in self._watches[name]:
            if watch.direction == "backward":
                continue
            if watch.source == "input":
                value = args[0] if args else next(iter(kwargs.values()), None)
            elif reused:
                continue
            else:
                value = getattr(module, watch.source, None)
            if isinstance(value, torch.Tensor):
                self._observe(name, watch, module, value)

    def _hook_gradient(self, name: str, module: nn.Module, args: tuple, output: Any) -> None:
        """Hook the gradient of the output tensor, not the module (a full backward hook): the
        module hook's outputs are views that a model's in-place add forbids (Falcon's
        `mlp_output += attention_output`); a tensor hook sees the gradient of the value the
        layer returned, whatever is done to it in place later."""
        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(_GradHook(_WeakHook(self._backward, name), module))

    def _backward(self, name: str, module: nn.Module, grad_output: tuple) -> None:
        for watch in self._watches[name]:
            if watch.direction == "backward" and grad_output and grad_output[0] is not None:
                self._observe(name, watch, module, grad_output[0])

    def _observe(self, name: str, watch: Watch, module: nn.Module, value: torch.Tensor) -> None:
        step = self._step
        assert step is not None
        idx = self._row[(name, watch.name)]
        if idx in step.seen:  # a recompute repeats the micro-batch: first sighting wins
            # ... but without micro-batch boundaries it may be a later micro-batch: its NaN/Inf
            # in an input or gradient still shows (a weight is the same in every one)
            if idx in step.pending and watch.source in ("input", "grad_output"):
                row = step.pending[idx]
                torch.maximum(row[_NONFINITE], nonfinite_seen(value), out=row[_NONFINITE])
            return
        step.seen.add(idx)
        if idx in step.pending and watch.source not in ("input", "grad_output"):
            # a weight is the same tensor in every micro-batch: its first cast of the step is
            # its statistics, as in TE's debug API (debug/features/utils/__init__.py,
            # `get_reduction_params`: reduce_within_microbatch is False for the weight); pooled
            # per micro-batch, its NaN/Inf counts were the micro-batch count times its own
            return
        mode = step.modes.get(name)
        uncast = mode is not None and not mode.casts(watch.direction)
        whatif = mode is None or uncast or (mode.delayed and watch.slot is None)
        if whatif:
            recipe = self.config.recipe
            fmt, power_2 = recipe.format_for(watch.direction), recipe.use_power_2_scales
            scale = self._scale[idx] if recipe.scaling == "delayed" else None
            initial = scale is not None and self._folds == 0
        else:
            assert mode is not None
            fmt, power_2 = mode.fmt(watch.direction), mode.power_2
            scale, initial = cast_scale(module, watch) if mode.delayed else (None, False)
        if not step.logging:
            if whatif:
                self._note_amax(idx, te_amax(value))
            return
        row = sufficient_stats(value, fmt, scale, power_2=power_2)
        if whatif and step.recording:  # the amax TE records: an Inf in, as `amax` keeps it
            self._note_amax(idx, torch.where(row[SUFFICIENT_INDEX["inf_count"]] > 0, torch.inf,
                                             row[SUFFICIENT_INDEX["amax"]]).float())
        earlier = step.pending.get(idx)  # the step's earlier micro-batches
        step.pending[idx] = row if earlier is None else pool_sufficient_stats(earlier, row)
        step.formats[idx] = fmt
        if whatif:
            step.whatif.add(idx)
        if uncast:
            step.uncast.add(idx)
        if initial is not False and idx not in step.initial:  # the step's first cast decides
            step.initial[idx] = initial
        if step.dumping and earlier is None and name in self.dump_names:  # first micro-batch's
            cast = -torch.maximum(row[SUFFICIENT_INDEX["neg_scale"]],
                                  row[SUFFICIENT_INDEX["neg_idle_scale"]])  # its own scale
            self._add_dump(f"{name}/{watch.name}", value, cast,
                           {"layer": self.short[name], "format": fmt,
                            "scale": "what-if" if whatif else "cast"})

    def _note_amax(self, idx: int, amax: torch.Tensor) -> None:
        step = self._step
        assert step is not None
        if step.amax is None:
            step.amax = torch.zeros(len(self.rows), device=amax.device)
        # the largest over the step's micro-batches: one history entry per step (TE rolls one
        # per micro-batch, so its history spans fewer steps)
        step.amax[idx] = torch.maximum(step.amax[idx], amax)

    def _add_dump(self, key: str, value: torch.Tensor, scale: torch.Tensor,
                  meta: dict[str, str]) -> None:
        """Keep a copy of the high-precision tensor and its scale, until the size cap; `meta`:
        what the file says of it (`_write_dump`)."""
        step = self._step
        assert step is not None
        size = value.numel() * value.element_size() + 4
        if step.left_out or step.dump_bytes + size > self.config.dump_max_mb * 2**20:
            step.left_out[key] = size
            return
        step.dump[key] = value.detach().clone()
        step.dump[f"{key}/scale"] = scale.float().reshape(())
        step.dump_meta[key] = meta
        step.dump_bytes += size

    def abort(self) -> None:
        """Remove hooks and drop what this step collected (no collectives)."""
        self._unhook()
        self._step = None

    def fail(self, error: BaseException) -> None:
        """Record a failure of ours on this rank and stop collecting. The armed step's and later
        steps' collectives still run; the first logging step pools the flag and `finish_step`
        raises FP8MonitorError on every rank there."""
        if self.error is None:
            self.error = error
        self._unhook()

    def _unhook(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def finish_step(self, fallbacks: Collection[str] = ()) -> dict[str, float]:
        """Remove hooks; on a logging step, pool the statistics over ranks and return the
        step's series (`health.keys` layout), warning once per layer, tensor and rule flagged
        (one warning per rule where more than `GROUP_EACH` are new at once).
        `fallbacks`: layers (names as in the keys) a guard ran in high precision in this step;
        their what-if rows stay out of the summary series (`summary_metrics`' `left_out`).
        Raises FP8MonitorError when the monitor failed on any rank: in a single
        process at once, under several ranks on every rank at the first logging step since."""
        step = self._step
        self.abort()
        self.pooled = False
        if step is None:
            return {}
        distributed = multi_rank()
        if step.recording:
            self._fold_amax(step, distributed)
        if step.dumping and self.error is None:
            self._attempt(self._write_dump, step)  # before the pooling, which reports its failure
        if not step.logging:
            if self.error is not None and not distributed:
                self._raise_failure(1)
            return {}  # under several ranks, the next logging step's reduce reports it
        return self._pool(step, distributed, fallbacks)

    def _raise_failure(self, ranks: int) -> NoReturn:
        raise FP8MonitorError(f"fp8 monitor failed on {ranks} rank(s)"
                              + (f": {self.error!r}" if self.error else "")) from self.error

    def _fold_amax(self, step: _Step, distributed: bool) -> None:
        """One delayed-scaling update of the what-if state with this step's amaxes (reduced
        across ranks as TE's `reduce_amax` does); stays on the device. A rank that failed
        only joins the all_reduce."""
        amax = step.amax if step.amax is not None else torch.zeros(len(self.rows),
                                                                    device=self._device())
        if distributed and self.config.recipe.reduce_amax:
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
        if self.error is None:
            self._attempt(self._update_whatif, amax)

    def _update_whatif(self, amax: torch.Tensor) -> None:
        assert self._history is not None and self._scale is not None
        self._history[0] = amax.to(self._history.device)
        recipe = self.config.recipe
        self._history, self._scale = delayed_scale_update(
            self._history, self._scale, self._whatif_fp8_max, recipe.amax_compute_algo,
            recipe.margin)
        self._folds += 1

    def _pool(self, step: _Step, distributed: bool, fallbacks: Collection[str],
              ) -> dict[str, float]:
        n = len(self.rows)
        device = next(iter(step.pending.values())).device if step.pending else self._device()
        # rows: the n statistics, the error flag, then the initial-scale marks packed into the
        # summed columns, pooled too so that every rank judges the same table: a row is marked
        # where a rank cast nonzero values at the initial scale, or where every rank's values
        # were 0 and one cast at it. With `reduce_amax: false` a rank whose tensor was 0 (or
        # empty: an expert without tokens) so far still casts at 1 while the others do not;
        # its zeros move no statistic, so the row is judged on the others' casts
        width = len(SUM_KEYS)  # the columns a SUM pools
        # ... and in the MAX columns of those rows, each row's fingerprint (`_FINGERPRINT`) and
        # its negation: its largest and smallest value over the ranks that saw it
        packed = max(-(-2 * n // width), -(-2 * len(_FINGERPRINT) * n // len(MAX_KEYS)))
        table = empty_sufficient_stats(n + 1 + packed, device)
        for idx, row in step.pending.items():
            table[idx] = row
        prints = table[:n, [SUFFICIENT_INDEX[key] for key in _FINGERPRINT]]
        prints = torch.cat([prints, -prints])  # a rank that did not see a row moves neither
        prints[torch.cat([table[:n, SUFFICIENT_INDEX["seen"]]] * 2) == 0] = -torch.inf
        fingerprints = torch.full((packed * len(MAX_KEYS),), -torch.inf, dtype=torch.float64,
                                  device=device)
        fingerprints[:prints.numel()] = prints.reshape(-1)
        table[n, SUFFICIENT_INDEX["seen"]] = float(self.error is not None)
        marks = torch.zeros(packed * width, dtype=torch.float64, device=device)
        for idx, initial in step.initial.items():
            marks[idx] = initial  # with nonzero values, masked below
            marks[n + idx] = initial
        amax = table[:n, SUFFICIENT_INDEX["amax"]]
        marks[:n] *= amax > 0
        table[n + 1:, :width] = marks.view(packed, width)
        table[n + 1:, width:] = fingerprints.view(packed, len(MAX_KEYS))
        if distributed:
            all_reduce_sufficient_stats(table)
            self._count_replicas_once(table, n)
        seen = table[:n + 1, SUFFICIENT_INDEX["seen"]]
        marks = table[n + 1:, :width].reshape(-1)
        marks = ((marks[:n] > 0) | ((marks[n:2 * n] > 0) & (amax <= 0))).double()
        host = torch.cat([finalize_stats(table[:n]).reshape(-1), seen, marks]).cpu().tolist()
        if host[-n - 1] > 0:  # the error flag; the one host transfer of this step is above
            self._raise_failure(int(host[-n - 1]))
        self.pooled = True
        self.table, self.judged, self.flags = {}, {}, {}  # not the last step's, should
        # `_metrics` fail here
        return self._attempt(self._metrics, step, host, fallbacks) or {}

    def _count_replicas_once(self, table: torch.Tensor, n: int) -> None:
        """A weight row whose fingerprint was the same on every rank that saw it is one weight
        seen several times: its sums divided by those ranks are its own (NaN/Inf counts; the
        ratios do not change). Rows differing somewhere (expert parallelism) keep the sum."""
        k = len(_FINGERPRINT) * n
        pooled = table[n + 1:, len(SUM_KEYS):].reshape(-1)
        largest, smallest = pooled[:k].view(n, -1), -pooled[k:2 * k].view(n, -1)
        seen = table[:n, SUFFICIENT_INDEX["seen"]]
        same = torch.isclose(largest, smallest, rtol=_SAME_WEIGHT_RTOL, atol=0).all(dim=1)
        once = same & self._weight_rows.to(table.device) & (seen > 1)
        table[:n, :len(SUM_KEYS)] /= torch.where(once, seen, 1.0).unsqueeze(1)

    def _metrics(self, step: _Step, host: list[float], fallbacks: Collection[str],
                 ) -> dict[str, float]:
        """Per-layer and summary series (`health.keys` layout); warns once per layer, tensor
        and rule that the health rules flag, in one warning per rule where more than
        `GROUP_EACH` are new at once (`grouped_message`, `nonfinite_message`)."""
        n, width = len(self.rows), len(STAT_KEYS)
        table: dict[tuple[str, str], dict[str, float]] = {}
        for i, (layer, tensor) in enumerate(self.rows):
            if host[n * width + i] == 0:
                continue  # no rank saw this tensor (layer unused this step)
            stats = dict(zip(STAT_KEYS, host[i * width:(i + 1) * width], strict=True))
            if host[n * width + n + 1 + i] > 0:  # delayed scaling's first cast (scale 1): so
                stats[INITIAL_SCALE] = 1.0  # marked, and neither flagged nor the run's worst
            table[(self.short[layer], tensor)] = stats
        # this rank's view, as `initial`: every rank runs the same layers in FP8
        self.uncast_rows = {(self.short[self.rows[i][0]], self.rows[i][1])
                            for i in step.uncast} & table.keys()
        if self._override_in_force(step) is not None:  # a fallback layer back in FP8 casts no
            # dY either
            self.uncast_rows |= {key for key in table
                                 if key[0] in fallbacks and direction(key[1]) == "backward"}
        judged = judged_table(table, self.uncast_rows)
        self.whatif_rows = {(self.short[self.rows[i][0]], self.rows[i][1]) for i in step.whatif}
        self.whatif_rows &= table.keys()
        # the margin the delayed FP8 layers cast with (their recipe's: te_swap's), which the
        # persistent-overflow advice raises by one; kept from the last step that had such layers
        if delayed := [mode for mode in step.modes.values() if mode is not None and mode.delayed]:
            self.tracker.margin = max(mode.margin for mode in delayed)
            # and the amaxes their scale is taken from, which the stale-scale advice names (one
            # layer's `max` history among `most_recent` ones keeps the history advice)
            lengths = {mode.history_len for mode in delayed}
            self.tracker.history_len = None if None in lengths else max(lengths)
        flags = self.tracker.update(step.step or 0, judged, self.whatif_rows - self.uncast_rows)
        self.table, self.judged, self.flags = table, judged, flags
        self.formats = {key: fmt.upper() for i, fmt in step.formats.items()
                        if (key := (self.short[self.rows[i][0]], self.rows[i][1])) in table}
        self.fallback_rows = {key for key in self.whatif_rows if key[0] in fallbacks}
        self.whatif_judged |= {key for key in self.whatif_rows - self.uncast_rows
                               if not table[key].get(INITIAL_SCALE)}
        self.initial_only |= {key for key, stats in judged.items() if stats.get(INITIAL_SCALE)}
        self.initial_only -= self.tracker.worst.keys()
        # what-if rows of layers that do cast in FP8, whose scale slot is not known here
        in_fp8 = {(self.short[self.rows[i][0]], self.rows[i][1]) for i in step.whatif
                  if step.modes.get(self.rows[i][0]) is not None}
        recipe = f"fp8_stats' recipe ({self.config.recipe.scaling} scaling)"
        def message(flag: Flag) -> str:
            key = (flag.layer, flag.tensor)
            runs: WhatIf = ("fallback" if key in self.fallback_rows else
                            "fp8" if key in in_fp8 else "high")
            return flag.whatif_message(recipe, runs) if key in self.whatif_rows else flag.message

        by_rule: dict[str, list[Flag]] = {}
        for found in flags.values():
            for flag in found:
                if flag.new:
                    by_rule.setdefault(flag.rule, []).append(flag)
        layers = [self.short[layer] for layer in self.layers]
        tensors = list(dict.fromkeys(tensor for _, tensor in self.rows))
        for rule, fresh in sorted(by_rule.items(), key=lambda item: item[0] != "nonfinite"):
            if len(fresh) <= GROUP_EACH:
                for flag in fresh:
                    self.on_warning(message(flag))
                continue
            ordered = cast_order(fresh, layers, tensors)
            if rule == "nonfinite":
                self.on_warning(nonfinite_message(ordered))
                continue
            said = {(flag.layer, flag.tensor): flag.yaml_key for flag in ordered
                    if (flag.layer, flag.tensor) not in self.fallback_rows}  # with a change
            first = said.get((ordered[0].layer, ordered[0].tensor))
            changes = [change for change in dict.fromkeys(said.values()) if change != first]
            self.on_warning(grouped_message(ordered, message(ordered[0]), self.whatif_rows,
                                            changes))
        metrics = {layer_key(stat, tensor, layer): value
                   for (layer, tensor), stats in table.items() for stat, value in stats.items()}
        # the uncast rows' tensors keep their summary series (worst values of the cast rows)
        metrics.update({layer_key(UNCAST, tensor, layer): 1.0 for layer, tensor in self.uncast_rows})
        # rows of layers with no FP8 cast (te_swap's exclude, fp8_guard's fallback): what-if
        # numbers, so marked for the report, which else read them as the layer's FP8 casts
        self.high_rows = self.whatif_rows - in_fp8 - self.uncast_rows
        metrics.update({layer_key(HIGH_PRECISION, tensor, layer): 1.0
                        for layer, tensor in self.high_rows})
        summarised = {**{key: uncast_stats(table[key]) for key in self.uncast_rows}, **judged}
        metrics.update(summary_metrics(summarised, flags, self.fallback_rows))
        for key in _uncounted_worst(summarised, self.fallback_rows):
            del metrics[key]
        return metrics

    def _override_in_force(self, step: _Step) -> str | None:
        """The NVTE_BACKWARD_OVERRIDE a layer back in FP8 would run under: the recipe's of this
        step's FP8 layers, else of the last step with one (every layer in fallback now), else,
        before any FP8 forward (every layer in fallback since a resume), the variable as
        fp8_stats' recipe would take it (TE's recipe reads it by default)."""
        modes = [mode for mode in step.modes.values() if mode is not None]
        if modes:
            self._override, self._seen_override = modes[0].backward_override, True
        if self._seen_override:
            return self._override
        try:
            return emulate.backward_override(self.config.recipe)
        except RecipeError:  # delayed scaling: TE refuses the override with it
            return None

    def _write_dump(self, step: _Step) -> None:
        """One safetensors file per step and rank: `<layer>/<tensor>` and its `/scale`, and in
        the file's metadata what a reader needs to redo the cast without our code: per tensor
        the layer's name in the metric keys and warnings, the FP8 format and whether the scale is
        the one the layer cast with or fp8_stats' what-if (a layer not in FP8, or in fp8_guard's
        fallback). The path is kept in `dumped` for the caller to name."""
        import json

        from safetensors import SafetensorError
        from safetensors.torch import save_file

        assert step.step is not None and self.config.dump_folder is not None
        rank = torch.distributed.get_rank() if multi_rank() else 0
        folder = Path(self.config.dump_folder)
        path = folder / DUMP_FILE.format(step=step.step, rank=rank)
        if not step.dump:  # no empty file: a reader would take it for a dump
            self._warn_nothing_dumped(step, path)
            return
        tensors = {k: v.detach().cpu().contiguous() for k, v in step.dump.items()}
        try:
            folder.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(path), metadata={
                "step": str(step.step), "rank": str(rank), "tensors": json.dumps(step.dump_meta),
                "about": DUMP_ABOUT})
            set_plain_mode(path)  # safetensors writes it 0600 (a temporary file, a rename)
        except (OSError, SafetensorError) as e:  # a full disk, a folder gone unwritable: skip
            # this dump, statistics go on (and the ranks stay in step)
            if not self._dump_failed:
                self.on_warning(f"fp8 dump {path} not written ({e}); the statistics go on, "
                                "later dumps are tried and not reported")
            self._dump_failed = True
            return
        self.dumped.append((path, len(step.dump_meta)))
        if step.left_out:
            self.on_warning(f"fp8 dump {path}: dump_max_mb={self.config.dump_max_mb:g} reached; "
                            f"left out: {', '.join(step.left_out)} (raise dump_max_mb or narrow "
                            "dump_layers)")

    def _warn_nothing_dumped(self, step: _Step, path: Path) -> None:
        """Why `path` is not written; nothing where `dump_layers` selects no layer (said once,
        when the monitor was built)."""
        if step.left_out:
            first, size = next(iter(step.left_out.items()))
            self.on_warning(f"fp8 dump {path} not written: dump_max_mb="
                            f"{self.config.dump_max_mb:g} holds none of its "
                            f"{len(step.left_out)} tensors (the first, {first}, takes "
                            f"{size / 2**20:.3g} MiB with its scale; raise dump_max_mb)")
        elif self.dump_names:
            self.on_warning(f"fp8 dump {path} not written: none of the {len(self.dump_names)} "
                            "layers dump_layers selects ran in this step")

    def summary(self) -> str:
        """The worst value per layer and tensor over every judged step (markdown), each row
        marked by where its worst values came from (`render_table`'s `cells`: what-if numbers
        only, in part, or FP8 casts), and the rows never judged."""
        table = render_table(self.tracker.worst, cells=self._whatif_cells())
        if not self.initial_only:
            return table
        rows = ", ".join(f"{layer} {tensor}" for layer, tensor in sorted(self.initial_only))
        return (f"{table}\nNever judged (cast with delayed scaling's initial scale 1 at every "
                f"logging step: no nonzero amax recorded before it, at a run's first step or for "
                f"a tensor always 0, such as the gradient of a layer that does not reach the "
                f"loss): {rows}\n")

    def _whatif_cells(self) -> set[tuple[str, str, str]]:
        """The (layer, tensor, stat) whose worst value only what-if numbers reached (the
        tracker's `whatif_worst`, with `_origin_unknown`'s cells of what-if rows)."""
        worst = self.tracker.worst
        return self.tracker.whatif_worst | {
            (*row, stat) for row, stats in self._origin_unknown.items()
            if row in self.whatif_judged for stat, value in stats.items()
            if worst.get(row, {}).get(stat) == value}

    # -- checkpoint state: a resumed run logs what the uninterrupted one logs -------------------

    def state_dict(self) -> dict[str, Any]:
        """What later steps' series and the summary depend on: the health tracker's state, the
        delayed what-if's (amax history, scale, updates so far; on the CPU), by row name, and
        the rows the summary marks as what-if. Only the what-if differs between ranks, and only
        with `reduce_amax: false`."""
        tracker = self.tracker.state_dict()
        tracker["whatif_worst"] = [list(cell) for cell in sorted(self._whatif_cells())]
        return {"rows": [list(row) for row in self.rows], "tracker": tracker,
                "whatif": self.whatif_state(),
                "whatif_judged": [list(row) for row in sorted(self.whatif_judged)]}

    def whatif_state(self) -> dict[str, Any] | None:
        """The delayed what-if's state (None before its first recorded batch, or none kept)."""
        if self._history is None or self._scale is None:
            return None
        return {"recipe": _whatif_recipe(self.config), "folds": self._folds,
                "history": self._history.detach().cpu().clone(),
                "scale": self._scale.detach().cpu().clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> list[str]:
        """Go on from `state_dict()`'s state, row by row where the rows (layers, tensors) and
        the what-if's recipe still match; returns what was left out, in words (empty: all
        restored). Raises ValueError on a malformed state, changing nothing."""
        try:
            saved_rows = [(layer, tensor) for layer, tensor in state["rows"]]
            if not all(isinstance(name, str) for row in saved_rows for name in row):
                raise TypeError("row names are not text")
            tracker, whatif = state["tracker"], state["whatif"]
            saved_judged = state.get("whatif_judged")  # None: saved by an earlier version
            judged = None if saved_judged is None else {
                (layer, tensor) for layer, tensor in saved_judged}
            if judged and not all(isinstance(name, str) for row in judged for name in row):
                raise TypeError("what-if row names are not text")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not fp8_stats' monitor state ({type(e).__name__}: {e})") from e
        notes: list[str] = []
        columns = self._whatif_columns(whatif, saved_rows, notes)  # validates before any write
        watched = {(self.short[layer], tensor) for layer, tensor in self.rows}
        gone = {(short_layer(layer), tensor) for layer, tensor in saved_rows} - watched
        gone.update(self.tracker.load_state_dict(tracker, watched))
        self._origin_unknown = {} if "whatif_worst" in tracker else {
            row: dict(stats) for row, stats in self.tracker.worst.items()}
        if gone:
            names = [f"{layer}/{tensor}" for layer, tensor in sorted(gone)]
            more = f" and {len(names) - 8} more" if len(names) > 8 else ""
            notes.insert(0, f"{', '.join(names[:8])}{more} (not watched now)")
        if columns is not None:
            self._restore_whatif(*columns)
        if judged is None:
            notes.append("which rows had what-if numbers before it (the fit-end summary marks "
                         "those seen since)")
        else:
            self.whatif_judged = judged & watched
        return notes

    def _whatif_columns(self, whatif: Any, saved_rows: list[tuple[str, str]], notes: list[str],
                        ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The saved what-if state, laid out on this monitor's rows (a row not in the
        checkpoint starts fresh), or None when there is none to restore (noted in `notes`)."""
        if whatif is None:
            return None
        try:
            recipe, folds = dict(whatif["recipe"]), int(whatif["folds"])
            history, scale = whatif["history"], whatif["scale"]
            n = len(saved_rows)
            if not (isinstance(history, torch.Tensor) and isinstance(scale, torch.Tensor)
                    and history.dim() == 2 and history.shape[1] == n and scale.shape == (n,)
                    and history.shape[0] == recipe.get("amax_history_len")):
                raise ValueError(f"what-if history/scale shapes do not fit {n} rows")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not fp8_stats' what-if state ({type(e).__name__}: {e})") from e
        now = _whatif_recipe(self.config)
        if now != recipe:
            changed = (["scaling"] if now.get("scaling") != recipe.get("scaling") else
                       sorted(k for k in {*now, *recipe} if now.get(k) != recipe.get(k)))
            notes.append("the what-if's delayed scales (recipe " + ", ".join(
                f"{k} {recipe.get(k)} -> {now.get(k)}" for k in changed) + "), which start afresh")
            return None
        # matched by the names in the metric keys, as the tracker is: wrappers that differ
        # between the runs (activation checkpointing, FSDP) do not lose the scales
        where = {(short_layer(layer), tensor): j for j, (layer, tensor) in enumerate(saved_rows)}
        new_history = torch.zeros(history.shape[0], len(self.rows))
        new_scale = torch.ones(len(self.rows))
        for i, (layer, tensor) in enumerate(self.rows):
            if (j := where.get((self.short[layer], tensor))) is not None:
                new_history[:, i], new_scale[i] = history[:, j], scale[j]
        return new_history, new_scale, folds

    def _restore_whatif(self, history: torch.Tensor, scale: torch.Tensor, folds: int) -> None:
        device = self._device()
        self._history, self._scale = history.to(device), scale.to(device)
        self._whatif_fp8_max = self._whatif_fp8_max.to(device)
        self._folds = folds


def _whatif_recipe(config: MonitorConfig) -> dict[str, Any]:
    """The recipe fields the what-if's state depends on (`reduce_amax` only says whether ranks
    share it)."""
    if config.recipe.scaling != "delayed":
        return {"scaling": config.recipe.scaling}
    return {k: v for k, v in config.recipe.as_config().items() if k != "reduce_amax"}

