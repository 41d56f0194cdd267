"""`fp8_guard`: the Composer callback that moves an FP8 layer whose health fails to high precision
mid-run (`callbacks: {fp8_stats: {...}, fp8_guard: {...}}`). Decisions: `foundry_fp8.guard`."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import weakref
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from composer.core import Callback, State
from composer.loggers import ConsoleLogger, Logger, LoggerDestination
from composer.utils import dist
from torch import nn

from foundry_fp8 import emulate
from foundry_fp8.composer.destinations import ConsoleResend, FitEndKeys, capped, deliver
from foundry_fp8.composer.stats import FP8Stats, last_batch
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.fp8_meta import canonical_name, fp8_modules, read_fp8_meta, write_fp8_meta
from foundry_fp8.guard import (
    FALLBACK_LAYERS,
    FALLBACKS_KEY,
    FP8_FLOPS_SHARE,
    OPTION,
    GuardBudgetError,
    GuardConfig,
    GuardCore,
    GuardStateError,
    fallback_message,
    named_layers,
    nonfinite_message,
    render_fallbacks,
    repromotion_message,
    static_yaml,
    whole_run,
)
from foundry_fp8.health import TENSORS, short_layer
from foundry_fp8.health.rules import model_blocks
from foundry_fp8.monitor import multi_rank, select_layers
from foundry_fp8.options import ENTRIES, MonitorConfig, OptionError, Problem, build
from foundry_fp8.swap import (
    SwapPlan,
    fp8_module_counts,
    linear_flops,
    module_flops,
    original_shapes,
    would_run_fp8,
)
from foundry_fp8.te import probe
from foundry_fp8.te.extra_state import EXTRA_STATE_SUFFIX

log = logging.getLogger(__name__)

#: the one key of fp8_guard's checkpoint state: its core's state as a JSON string
DECISIONS = "decisions"
#: a sharded checkpoint without fp8_guard's state (`accept_absent_state`), %s: where
_NO_DECISIONS = ("fp8_guard: %s holds no fp8_guard state (saved without fp8_guard, or before "
                 "foundry-fp8 kept it in sharded checkpoints); fp8_guard starts with every layer "
                 "in FP8 and no decision")

#: every guard alive in this process: a fit start takes another's hooks off its model (`_start`)
_guards: weakref.WeakSet[FP8Guard] = weakref.WeakSet()


def checkpointed_core(entry: Mapping[str, Any]) -> Any:
    """fp8_guard's `GuardCore.state_dict` in its checkpoint entry (None: none): DECISIONS' JSON,
    or the `core` dict of checkpoints saved before DECISIONS."""
    return json.loads(entry[DECISIONS]) if DECISIONS in entry else entry.get("core")


class FP8Guard(Callback):
    """Watches fp8_stats' pooled statistics at each of its logging steps; an FP8 layer that a
    health rule flags (over `consecutive` logging steps) runs its GEMMs in high precision from the
    next step on, weights, optimizer state and parameter names untouched (until the Trainer
    closes: `close`). Every rank takes the same decision at the same step (one MAX all_reduce of the candidates per logging step).

    At most `max_fallback_share` of the FP8 FLOPs fall back; past it, `strict: true` stops the
    run, else the guard warns and the layer stays in FP8. Decisions are in the checkpoint (this
    callback's state) and apply again on resume. Each fallback is logged once (warning) with the
    numbers that flagged it and the equivalent static `te_swap: {exclude: ...}`.

    NaN/Inf in a high-precision tensor is no FP8 failure and a fallback cannot fix it: a layer
    holding any is not judged at that logging step (the others are), and the guard names each
    such layer once, at the first logging step it holds NaN/Inf. It also says once when fp8_stats
    gives it nothing (more) to judge: off (its `layers` select no layer, or an error of its own)
    or no logging step left in the run (its `end` included); at fit start, which FP8 layers and
    tensors fp8_stats does not watch (never judged), and fewer logging steps left than
    `consecutive` (no layer can fall back). A second FP8Guard in one Trainer is refused.

    Logs, by rank 0 at fp8_stats' logging steps: `fp8/guard/fallback_layers` (layers in
    fallback) and `fp8/guard/fp8_flops_share` (share of the linear-GEMM FLOPs still in FP8; on
    the console too, past an evaluation: `destinations.ConsoleResend`), and for each layer moved
    `fp8/guard/in_fallback/<layer>` (1 in fallback, 0 back in FP8; not on the console), from
    which `foundry-fp8 report` takes every span's steps; at
    each fallback, and again on resume, the hyperparameter `fp8/guard/fallback/<layer>` (layer,
    step, FLOPs share, what flagged it and every statistic of the layer at that step, read back
    by `foundry-fp8 report`), at each re-promotion (`repromote_after`)
    `fp8/guard/repromotion/<layer>` (`.ba<step>` after a layer's first), both only for a layer's
    first `guard.KEPT_DECISIONS` fallback/re-promotion pairs (loggers keep every key ever
    given), then at 1, 2, 4, 8, ... pairs past those `fp8/guard/summary/<layer>.ba<step>`
    (layer, the last counted re-promotion's step, the pairs counted, the first one's fallback
    step; the checkpoint keeps the last pairs whole and this count), at a layer's first
    refusal by the budget `fp8/guard/refused/<layer>` (layer, step, its FLOPs share, the share of
    the FP8 FLOPs that would then be in high precision, `max_fallback_share`); at fit end the
    hyperparameter `fp8/guard/fallbacks` (the table it prints, cut at a row to MLflow's 6000
    characters; `fp8/guard/fallbacks.ba<step>` after a resume or at a second fit's end, as
    fp8_stats' summary). It tells fp8_stats which
    layers it runs in high precision (`FP8Stats.fallbacks`): their what-if rows leave fp8_stats'
    summary series (`fp8/flagged_layers` stops counting a layer once the guard has acted), and
    its table marks them; the guard's own judgement of the what-if rows is unchanged.

    With `repromote_after`, a layer in fallback whose what-if statistics (fp8_stats computes
    them for a layer in high precision) stay within the limits that many logging steps in a row
    runs in FP8 again from the next step, with a fresh delayed-scaling state (history 0, scale
    1, as a new layer: the old history holds the amaxes that made it fall back).

    The guard's own errors switch it off (every rank together, at the logging step of the error
    or, for one while acting on an agreed decision, at the next; layers already in fallback stay
    so) unless `strict: true`. A logger destination that raises is not the guard's error: it is
    warned once per destination and kind, the other destinations still get the values
    (`composer.destinations.deliver`) and the guard goes on acting; `strict: true` stops the
    run instead.
    """

    def __init__(self, **options: Any):
        self.config: GuardConfig = build("fp8_guard", options)  # one line naming the key
        self.core: GuardCore | None = None
        self.disabled = False
        self._restored: Mapping[str, Any] = {}  # the checkpoint's entry, decoded at fit_start
        self._modules: dict[str, nn.Module] = {}
        self._handles: dict[str, list[Any]] = {}
        _guards.add(self)
        self._exclude: str | None = None
        self._state: State | None = None
        self._logger: Logger | None = None
        self._stats: FP8Stats | None = None  # told which layers run in high precision
        self._stop: BaseException | None = None  # raised at the next batch_end/batch_checkpoint
        # strict: acting failed on this rank alone, raised once every rank learns it (next vote)
        self._pending_stop: BaseException | None = None
        # acting failed here after the ranks agreed: told to the others at the next vote, so no
        # rank leaves the votes' all_reduce alone (its partner would be another collective)
        self._act_failed = False
        self._heard = False  # fp8_stats called the guard at a logging step of this fit
        self._said: set[str] = set()  # the one-time warnings given: "inert"
        self._named: set[str] = set()  # the layers a NaN/Inf line has named
        self._table_keys = FitEndKeys(FALLBACKS_KEY)
        self._resend = ConsoleResend()  # what an evaluation kept off the console
        self._logged: set[str] = set()  # the records' keys logged to this Trainer's loggers

    # events

    def init(self, state: State, logger: Logger) -> None:
        # a new Trainer's loggers have none of the records; a second fit() of one Trainer sends
        # none again (MLflow's queue refuses a batch naming a key twice, its losses included)
        self._logged.clear()

    def before_load(self, state: State, logger: Logger) -> None:
        try:
            accept_absent_state(type(self).__qualname__, _NO_DECISIONS)
        except Exception:  # our bug: Composer's strict sharded load stays as it was
            log.exception("fp8_guard: internal error preparing the checkpoint load")

    def fit_start(self, state: State, logger: Logger) -> None:
        stats = next((c for c in state.callbacks if isinstance(c, FP8Stats)), None)
        if stats is None:
            raise OptionError(OPTION, ENTRIES["fp8_guard"].need_problem("fp8_stats"))
        if any(isinstance(c, FP8Guard) and c is not self for c in state.callbacks):
            # the second judged the layers the first moved by their what-if numbers, moved them
            # "again" and logged another record under the same key (W&B refuses the change)
            raise OptionError(OPTION, Problem(
                "", "value", "is given twice to this Trainer (two FP8Guard callbacks): each "
                "would move the other's layers in fallback again, by their what-if statistics, "
                "and log conflicting records under the same keys", "keep one fp8_guard"))
        self._state, self._logger, self._stats = state, logger, stats
        self._heard = False
        self._said.discard("inert")
        error: Exception | None = None
        try:
            self._table_keys.fit_start(int(state.timestamp.batch))
            # a second fit() in this process keeps this one's decisions, as a resume does
            self._start(state, self.core.state_dict() if self.core is not None
                        else self._decoded(state),
                        "a new fit() keeps" if self.core is not None else "resumed with")
        except Exception as e:
            error = e
            if not self.config.strict:
                log.exception("fp8_guard failed to start; it is off for this run (strict: true "
                              "to fail instead)")
        failed = error is not None
        if multi_rank():  # one rank without a core cannot join the steps' all_reduce
            flag = state.device.tensor_to_device(torch.tensor([float(failed)]))
            dist.all_reduce(flag, reduce_operation="MAX")
            failed = bool(flag.item())
        if failed:
            self.disabled = True
            if self.config.strict:  # every rank stops here, none is left in a collective
                raise error if error is not None else RuntimeError(
                    "fp8_guard failed to start on another rank (its error is in that rank's "
                    "log); strict: true stops the run")
            return
        if self._listen not in stats.listeners:
            stats.listeners.append(self._listen)
        if not self._modules:  # its share would read 0 all run, as if every layer had fallen
            log.warning("fp8_guard: no layer of this model runs in FP8 (no te_swap, and no TE "
                        "layers or not under precision amp_fp8), so it has nothing to guard")
        elif not stats.disabled and dist.get_global_rank() == 0:
            try:
                self._say_unwatched(state, stats)
                self._say_too_few_steps(state, stats)
            except Exception:  # a warning's check, our bug: said, the guard and run go on
                log.exception("fp8_guard: internal error checking what fp8_stats gives it")

    def _say_too_few_steps(self, state: State, stats: FP8Stats) -> None:
        """A run with fewer of fp8_stats' logging steps left than `consecutive` can move no
        layer (a short fine-tune under `interval: 100ba`): said once at fit start. None left
        at all is `_inert`'s line."""
        schedule, last, consecutive = stats.schedule, last_batch(state), self.config.consecutive
        steps, step = 0, int(state.timestamp.batch) - 1
        while last is not None and steps < consecutive:
            step = schedule.next_log(step)
            if step is None or step > last:
                break
            steps += 1
        if 0 < steps < consecutive:
            log.warning("fp8_guard: fp8_stats has %d logging step(s) left in this run (it ends "
                        "after batch %s; %s.interval %s, start %s, end %s), fewer than %s."
                        "consecutive %d, so no layer can fall back in it: lower one of them",
                        steps, last, MonitorConfig.PATH, schedule.interval, schedule.start,
                        schedule.end, OPTION, consecutive)

    def _say_unwatched(self, state: State, stats: FP8Stats) -> None:
        """The FP8 layers fp8_stats' `layers`/`exclude` leave out, and the tensors its `tensors`
        leave out, get no statistics, so the guard never judges them: said once per fit (the
        docs promise every FP8 layer is judged)."""
        skipped = [tensor for tensor in TENSORS if tensor not in stats.config.tensors]
        if skipped:
            log.warning("fp8_guard: fp8_stats does not watch the %s of any layer (its %s.tensors "
                        "%s), so fp8_guard never judges them: a layer whose FP8 %s fails stays "
                        "in FP8", " or ".join(skipped), MonitorConfig.PATH,
                        list(stats.config.tensors), " or ".join(skipped))
        watched = {short_layer(name) for name in select_layers(state.model, stats.config)}
        unwatched = [layer for layer in self._modules if layer not in watched]
        if unwatched and watched:  # none watched: `_inert` says fp8_stats is off
            log.warning("fp8_guard: fp8_stats does not watch %d of the %d layers in FP8 (its "
                        "%s.layers/exclude), so fp8_guard never judges or moves them: %s",
                        len(unwatched), len(self._modules), MonitorConfig.PATH,
                        named_layers(unwatched))

    def _start(self, state: State, restored: Mapping[str, Any] | None, how: str) -> None:
        """Hook `restored`'s fallbacks (a checkpoint's, or an earlier fit()'s) into a fresh core:
        without them a layer would run FP8 again with the amax history that made it fall back."""
        self._remove_all()
        # a TE module the model was built with computes in FP8 only under amp_fp8 (te_swap's
        # plan says so too): judged otherwise, it counted as FP8 in the share and could
        # "fall back" from a precision it never ran in
        precision = state.precision.value
        self._modules = {short_layer(n): m for n, m in fp8_modules(state.model)
                         if would_run_fp8(precision, *fp8_module_counts(m))}
        swap = next((a for a in state.algorithms if isinstance(a, TESwap)), None)
        self._exclude = swap.config.exclude if swap is not None else None
        self._take_over(state.model)
        # the fallback reasons' edge blocks are the model's, counted as te_swap counts them
        # (swap.plan_swap: every name), not those of the layers judged
        flops = layer_flops(state.model, self._modules, swap.plan if swap is not None else None)
        blocks = model_blocks(name for name, _ in state.model.named_modules(remove_duplicate=False))
        self.core = GuardCore(self.config, flops, blocks)
        if restored is not None:
            try:
                self.core.load_state_dict(restored)
            except Exception as e:  # fields missing or of another type: another version's, edited
                self._unreadable(state, e)
                self.core = GuardCore(self.config, flops, blocks)
        held = self.core.held
        for layer in held:
            self._apply(layer)
        if held:
            log.warning("fp8_guard: %s %s in high precision", how, ", ".join(held))
        gone = [layer for layer in self.core.fallbacks if layer not in held]
        if gone and dist.get_global_rank() == 0:  # as the fallback's advice had it: no warning
            log.info("fp8_guard: %s (in fallback before) not in FP8 in this run (te_swap's "
                     "include/exclude changed?): it runs in high precision without fp8_guard, "
                     "outside its FLOPs shares and re-promotion", ", ".join(gone))
        self._log_records()  # a resumed run's records, for its own hparams.json or W&B run

    def _decoded(self, state: State) -> Any:
        """The checkpoint's decisions (`checkpointed_core`), None where it holds none or they
        cannot be read (`_unreadable`; later checkpoints then hold this run's own)."""
        try:
            return checkpointed_core(self._restored)
        except Exception as e:  # not JSON, or not the entry fp8_guard saves
            self._restored = {}
            self._unreadable(state, e)
            return None

    def _unreadable(self, state: State, error: Exception) -> None:
        """A checkpoint's fp8_guard entry it cannot read is one line, and the guard starts
        without decisions and goes on guarding (before, it switched itself off for the run,
        with a traceback); `strict: true` raises it."""
        first = (str(error).splitlines() or [""])[0][:200]
        said = (f"fp8_guard: {state.load_path or 'the checkpoint'}: its fp8_guard state is not "
                f"readable ({type(error).__name__}: {first})")
        if self.config.strict:
            raise GuardStateError(f"{said}; strict: true stops the run") from None
        log.warning("%s; fp8_guard starts with every layer in FP8 and no decision (layers it "
                    "held in high precision run in FP8 again) and guards on", said)

    def batch_end(self, state: State, logger: Logger) -> None:
        self._raise_stop()
        if "inert" in self._said or self.disabled or dist.get_global_rank() != 0:
            return
        try:
            why = self._inert(state)
        except Exception as e:  # a warning's check: logged (strict: raised), the guard goes on
            self._said.add("inert")
            self._own_error(e)
            return
        if why is not None:
            self._said.add("inert")
            held = (f"; the {len(self.core.fallbacks)} layer(s) in fallback stay in high precision"
                    if self.core is not None and self.core.fallbacks else "")
            log.warning("fp8_guard: %s, so fp8_guard judges nothing from now on in this run "
                        "and moves no layer%s", why, held)

    def _inert(self, state: State) -> str | None:
        """Why fp8_stats will call this guard at no logging step from now on in this fit (it
        switched itself off, or its schedule has no step left), None while it may."""
        assert self._stats is not None
        stats = self._stats
        if stats.disabled:
            if not select_layers(state.model, stats.config):
                return (f"fp8_stats is off: {MonitorConfig.PATH}.layers selects no layer (its "
                        f"warning above)")
            return "fp8_stats switched itself off after an error (its message above)"
        schedule, last, done = stats.schedule, last_batch(state), int(state.timestamp.batch) - 1
        following = schedule.next_log(done)
        if last is None or (following is not None and following <= last):
            return None
        if not self._heard:
            return (f"fp8_stats has no logging step in this run, which ends after batch {last} "
                    f"({MonitorConfig.PATH}.interval {schedule.interval}, start "
                    f"{schedule.start}, end {schedule.end})")
        # past the run's last logging step: said only where `end` cut the schedule short (the
        # guard stopped guarding with batches left, silently before)
        unbounded = dataclasses.replace(schedule, end=None).next_log(done)
        if unbounded is None or unbounded > last:
            return None
        return (f"fp8_stats has no logging step left in this run after step {done} "
                f"({MonitorConfig.PATH}.end {schedule.end}; the run ends after batch {last})")

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._raise_stop()

    def batch_start(self, state: State, logger: Logger) -> None:
        self._resend.resend("fp8_guard", self.config.strict)  # our bug there: said once

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._resend.resend("fp8_guard", self.config.strict)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._resend.fit_end("fp8_guard", self.config.strict)
        try:
            self._report_fallbacks(state, logger)
        except Exception as e:  # no collective follows on any rank: raised or said here
            if self.config.strict:
                raise
            log.error("fp8_guard: internal error at fit end (%r); the table of fallbacks is not "
                      "printed or logged (each fallback's own warning and record stand)", e,
                      exc_info=e)
        if self._pending_stop is not None:  # strict: no vote came after it in this fit
            error, self._pending_stop = self._pending_stop, None
            raise error

    def _report_fallbacks(self, state: State, logger: Logger) -> None:
        """Rank 0's fit-end table of every fallback, and the YAML for those still in place."""
        core = self.core
        if core is None or not (core.fallbacks or core.ended) or dist.get_global_rank() != 0:
            return
        table = render_fallbacks([*core.ended, *core.fallbacks.values()], core.fp8_flops_share,
                                 core.repromotions)
        # a fallback outside FP8 in this run is already kept out of it by te_swap's exclude
        whole = whole_run(core.held, core.flops, "are held in high precision at the end")
        next_time = (whole if whole else
                     f"Next time: {static_yaml(core.held, self._exclude)}" if core.held else
                     "te_swap already keeps the layers in fallback out of FP8." if core.fallbacks
                     else "No layer is in fallback at the end of the run.")
        print(f"foundry_fp8 fp8_guard: layers moved to high precision\n{table}\n{next_time}",
              flush=True)
        # cut at a row to MLflow's limit, as fp8_stats' summary: MLflow cuts mid-row, silently
        value = capped(table, "the whole table is printed at fit end; `foundry-fp8 report` "
                              "shows every fallback")
        self._log_hyperparameters(logger, {self._table_keys.key(int(state.timestamp.batch)): value})

    def close(self, state: State, logger: Logger) -> None:
        """The Trainer is done (Composer's `Trainer.close`, or at exit): the high-precision hooks
        come off the model, which a new Trainer (a notebook's next stage) may train, where no
        guard would know of them. A second fit() of this Trainer keeps them (fit_end leaves
        them)."""
        del state, logger
        self._remove_all()

    def state_dict(self) -> dict[str, Any]:
        """Always the one key DECISIONS, a string. Composer's sharded load (FSDP
        `state_dict_type: sharded`, FSDP2's default) asks for this state before fit as the
        template torch.distributed.checkpoint fills in place, by key: an earlier `{}` loaded
        nothing, and the resumed run put its fallen layers back in FP8. DCP saves a string whole,
        as one bytes item (torch/distributed/checkpoint/_traverse.py, `_is_terminal`), and its
        load replaces the template's value by key (default_planner.py, `load_bytes`)."""
        try:
            if self.core is not None:
                return {DECISIONS: json.dumps(self.core.state_dict())}
            return {DECISIONS: json.dumps(checkpointed_core(self._restored))}
        except Exception as e:  # no collective here: every rank saves on its own
            if self.config.strict:
                raise
            if "unsaved" not in self._said:  # once, not at every checkpoint
                self._said.add("unsaved")
                log.error("fp8_guard: internal error saving its decisions (%r); this checkpoint "
                          "holds none (nor will later ones while it fails): a resume from it "
                          "runs every layer in FP8", e, exc_info=e)
            return {DECISIONS: json.dumps(None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored = state
        if self.core is not None and self._state is not None:  # loaded after fit_start
            try:
                self._start(self._state, self._decoded(self._state), "resumed with")
            except Exception as e:
                if self.config.strict:
                    raise
                log.error("fp8_guard: internal error taking the loaded decisions (%r); it is off "
                          "from its next logging step, on every rank", e, exc_info=e)
                self._act_failed = True  # told at the next vote: no rank leaves it alone

    # the listener fp8_stats calls at each logging step, on every rank

    def _listen(self, step: int, table: Mapping[tuple[str, str], Mapping[str, float]],
                flags: Mapping) -> None:
        del flags  # the guard judges with its own thresholds (its tracker)
        if self.disabled or self.core is None:
            return
        self._heard = True
        core = self.core
        mine: list[str] = []
        ready: list[str] = []
        failed = self._act_failed
        if not failed:
            # all of this rank's own work before the vote is in here: a failure that skipped
            # the vote on one rank left the others in it, paired with that rank's next
            # collective (fallbacks from another collective's numbers, then a hang)
            try:
                if self._stats is not None and self._stats.monitor is not None:
                    # the margin the delayed FP8 layers cast with at this step (fp8_stats reads
                    # it from their recipe: `CastMode.margin`), which the persistent-overflow
                    # reason raises by one, and their amax history, which a stale scale
                    # outlasts before it moves a layer
                    tracker = self._stats.monitor.tracker
                    core.margin, core.history_len = tracker.margin, tracker.history_len
                table = {(short_layer(layer), tensor): stats
                         for (layer, tensor), stats in table.items()}
                mine = core.candidates(step, table)
                ready = core.ready(step, table)
            except Exception as e:
                self._own_error(e)
                failed = True  # told to every rank, strict or not
        agreed, ready, failed_on = self._agree(mine, ready, failed)
        if failed_on is not None and self.config.strict:
            # every rank raises at this BATCH_END: none goes on into a collective alone
            if self._stop is None:
                self._stop = self._pending_stop or RuntimeError(
                    f"fp8_guard failed on rank {failed_on} (its error is in that rank's log); "
                    "strict: true stops the run")
            return
        if failed_on is not None:
            # only rank 0's output reaches the console by default (composer's launcher drops
            # the others' unless --stdout/--stderr), so name the rank whose log holds the error
            where = ("on this rank (its error above)" if failed else
                     f"on rank {failed_on} (its error is in that rank's log)")
            log.error("fp8_guard failed %s; it is off from now on, on every rank (layers already "
                      "in fallback stay in high precision)", where)
            self.disabled = True
            return
        try:
            self._act(step, agreed, ready, table)
        except Exception as e:
            if self._own_error(e, raise_now=not multi_rank()) or multi_rank():
                # alone: the other ranks would wait in the next vote, paired by the backend
                # with this rank's next collective (gloo aborts the process on the mismatch);
                # under strict every rank raises after that vote
                self._act_failed = True
                if not multi_rank():
                    self.disabled = True
                    log.error("fp8_guard is off from now on (layers already in fallback stay "
                              "in high precision)")

    def _take_over(self, model: nn.Module) -> None:
        """Another guard's fallbacks still hooked into `model`: its Trainer was not closed
        (LLM-Foundry's `train()` returns it unclosed; a fit that raised is closed by no one).
        This guard would not know of them: the layers would run in high precision while its
        series said FP8. They go back to FP8 with a fresh delayed-scaling state (`_release`),
        as in a fresh run, and are judged by this guard; said once (rank 0)."""
        ours = {id(module) for module in model.modules()}
        moved: list[str] = []
        for guard in list(_guards):
            if guard is self:
                continue
            for layer in [name for name in guard._handles
                          if id(guard._modules.get(name)) in ours]:
                guard._release(layer)
                moved.append(layer)
        if moved and dist.get_global_rank() == 0:
            log.warning("fp8_guard: %s still ran in high precision by an earlier Trainer's "
                        "fp8_guard fallback (that Trainer was not closed); this run starts "
                        "them in FP8 again with a fresh delayed-scaling state and judges them "
                        "afresh (to keep that Trainer's decisions, resume from its checkpoint; "
                        "to keep them out of FP8: %s)", ", ".join(sorted(moved)),
                        static_yaml(moved, self._exclude))

    def _act(self, step: int, layers: list[str], ready: list[str], table: Mapping) -> None:
        assert self.core is not None
        refusals = len(self.core.refusals)
        verdict = self.core.decide(step, layers, table)
        rank_zero = dist.get_global_rank() == 0
        # each layer named once, when it first holds NaN/Inf: a layer going non-finite after
        # another is as unjudged as the first
        fresh = [row for row in self.core.nonfinite if row[0] not in self._named]
        if fresh:
            self._named.update(layer for layer, _ in fresh)
            if rank_zero:
                log.warning(nonfinite_message(step, fresh))
        for fallback in verdict.fallbacks:
            self._apply(fallback.layer)
            if rank_zero:
                log.warning(fallback_message(fallback, static_yaml([fallback.layer],
                                                                   self._exclude)))
        repromoted = self.core.repromote(step, ready, table)
        for back in repromoted:
            self._release(back.layer)
            if rank_zero:
                log.warning(repromotion_message(back))
        if verdict.fallbacks or repromoted or len(self.core.refusals) > refusals:
            self._log_records()
        if verdict.budget_message:
            if self.config.strict:
                self._stop = GuardBudgetError(verdict.budget_message)
            elif not set(verdict.refused) <= self.core.warned:
                self.core.warned.update(verdict.refused)
                if rank_zero:
                    log.warning("%s; the layer stays in FP8 (strict: true stops the run)",
                                verdict.budget_message)
        if rank_zero and self._logger is not None:
            series = {FALLBACK_LAYERS: float(len(self.core.fallbacks)),
                      FP8_FLOPS_SHARE: self.core.fp8_flops_share}
            layers = self.core.in_fallback()  # off the console, as fp8_stats' per-layer series

            def send(destination: LoggerDestination) -> None:
                sent = series if isinstance(destination, ConsoleLogger) else {**series, **layers}
                destination.log_metrics(sent, step)
                self._resend.sent(destination, sent, step)

            deliver(self._logger.destinations, "metrics", send, "fp8_guard", self.config.strict)

    def _log_records(self) -> None:
        """One hyperparameter per fallback, re-promotion, refusal and summary of older pairs
        (rank 0), never changed: W&B and MLflow refuse a changed value, so a layer's second one
        is `<layer>.ba<step>`; a layer's first KEPT_DECISIONS pairs only (`GuardCore.records`).
        Each decision logs the keys not logged yet (all of them again
        made the work grow with the square of the decisions); a new Trainer's start logs
        the kept ones again, for a resumed run's own hparams.json or W&B run. A logger that fails
        is reported; the guard goes on (`strict` raises)."""
        assert self.core is not None
        records = self.core.records()
        logged = {key: value for key, value in records.items() if key not in self._logged}
        if dist.get_global_rank() != 0 or self._logger is None or not logged:
            return
        self._logged.update(logged)
        self._log_hyperparameters(self._logger, logged)

    def _log_hyperparameters(self, logger: Logger, values: dict[str, Any]) -> None:
        """A logger that refuses (e.g. W&B, a changed value on a resumed run) is warned; the
        others still get the values and the run goes on (`strict` raises)."""
        deliver(logger.destinations, "hyperparameters",
                lambda d: d.log_hyperparameters(values), "fp8_guard", self.config.strict)

    def _own_error(self, error: Exception, raise_now: bool = True) -> bool:
        """True: switch off (logged); strict: kept to raise after fp8_stats' BATCH_END, or
        (`raise_now` False: a failure on one rank after the vote) after the next vote, where
        every rank learns of it."""
        if self.config.strict:
            if raise_now:
                self._stop = error
            else:
                self._pending_stop = error
            return False
        log.error("fp8_guard failed: %r", error, exc_info=error)
        return True

    def _raise_stop(self) -> None:
        if self._stop is not None:
            error, self._stop = self._stop, None
            raise error

    def _agree(self, mine: Iterable[str], ready: Iterable[str],
               failed: bool) -> tuple[list[str], list[str], int | None]:
        """The union of the ranks' candidates, the layers ready on every rank, and the highest
        rank that failed, None if none did (one all_reduce)."""
        layers = self.core.layers if self.core is not None else []
        chosen, fine = set(mine), set(ready)
        if not multi_rank():
            return sorted(chosen), sorted(fine), dist.get_global_rank() if failed else None
        assert self._state is not None
        n = len(layers)
        votes = torch.tensor([float(name in chosen) for name in layers]
                             + [float(name not in fine) for name in layers]
                             + [float(dist.get_global_rank() + 1) if failed else 0.0])
        votes = self._state.device.tensor_to_device(votes)
        dist.all_reduce(votes, reduce_operation="MAX")
        values = votes.cpu().tolist()
        return ([name for name, v in zip(layers, values[:n], strict=True) if v],
                [name for name, v in zip(layers, values[n:2 * n], strict=True) if not v],
                int(values[-1]) - 1 if values[-1] else None)

    # the switch

    def _apply(self, layer: str) -> None:
        if layer not in self._handles and layer in self._modules:
            self._handles[layer] = high_precision_hooks(self._modules[layer])
            self._tell_stats()

    def _release(self, layer: str) -> None:
        """Back to FP8 from the next forward: no hooks, and a fresh delayed-scaling state,
        written in place (TE's buffers reference the tensors)."""
        for handle in self._handles.pop(layer, ()):
            handle.remove()
        self._tell_stats()
        module = self._modules.get(layer)
        if module is not None:
            write_fp8_meta(module, {k: torch.ones_like(v) if k.endswith("_scale")
                                    else torch.zeros_like(v)
                                    for k, v in read_fp8_meta(module).items()})

    def _remove_all(self) -> None:
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles.clear()
        self._tell_stats()

    def _tell_stats(self) -> None:
        """fp8_stats leaves the what-if rows of the layers hooked into high precision out of its
        summary series (this guard's series report them) and marks them in its table."""
        if self._stats is not None:
            self._stats.fallbacks = frozenset(self._handles)


def high_precision_context(module: nn.Module) -> AbstractContextManager:
    """The autocast region in which `module` runs in high precision: a nested disabled one.

    It enters the enclosing recipe, not TE's default: an autocast's recipe, enabled or not,
    becomes the one the run's next update applies to every buffer under its text, which leaves
    out `amax_compute_algo` (`emulate.fp8_autocast`), so a default (`max`) region would have
    updated a `most_recent` run's scales with `max` after each fallback forward. With FP8 off
    (`emulate.active_recipe` is None) no region is entered: the layer already runs in high
    precision, and any region would enter some recipe.
    """
    if isinstance(module, emulate.EmulatedFP8Linear):
        recipe = emulate.active_recipe()
        return nullcontext() if recipe is None else emulate.fp8_autocast(enabled=False,
                                                                          recipe=recipe)
    if probe.is_te_fp8_module(module):
        from foundry_fp8.te import backend as te_backend

        return te_backend.te_high_precision(module)
    return nullcontext()


def high_precision_hooks(module: nn.Module) -> list[Any]:
    """Run `module`'s forward (and so its backward) in high precision from now on, by hooks:
    nothing of the module itself changes. The pre-hook runs first, so fp8_stats sees the layer
    as not in FP8 (what-if statistics); the exit hook also runs when the forward raises. Both
    run eagerly under torch.compile (`compile_config`): Dynamo traces a hook added after the
    model compiled and cannot return the context manager object the pre-hook opens."""
    regions: list[ExitStack] = []

    def enter(mod: nn.Module, args: Any) -> None:
        stack = ExitStack()
        stack.enter_context(high_precision_context(mod))
        regions.append(stack)

    def leave(mod: nn.Module, args: Any, output: Any) -> None:
        if regions:
            regions.pop().close()

    return [module.register_forward_pre_hook(torch.compiler.disable(enter), prepend=True),
            module.register_forward_hook(torch.compiler.disable(leave), always_call=True)]


def layer_flops(model: nn.Module, layers: Mapping[str, nn.Module],
                plan: SwapPlan | None) -> dict[str, float]:
    """Each FP8 layer's share of the model's linear-GEMM FLOPs, one count for every layer
    (`swap.module_flops` of `swap.linear_flops`, a tied LM head included): te_swap's `plan`
    share (counted before FSDP shards the weights; the plan holds every GEMM module, the TE
    modules the model was built with too), else (no te_swap, or a layer it did not see) the
    layer's own FLOPs of the same total."""
    planned: dict[str, float] = {}
    shapes = original_shapes(model)  # FSDP1's flattened weights: their shapes before the wrap
    total = linear_flops(model)
    if plan is not None:  # its notes (an LN-MLP not fused) weigh nothing: not layers
        planned = {short_layer(canonical_name(d.name)): d.flops_share for d in plan.decisions
                   if d.flops}
        total = plan.total_flops
    return {layer: planned.get(layer, module_flops(m, shapes.get(m)) / (total or 1))
            for layer, m in layers.items()}


#: our callbacks whose entry a sharded checkpoint may lack: qualname -> (the line that says so,
#: None: the callback says it itself; what completes its template, `accept_absent_state`)
_ABSENT_OK: dict[str, tuple[str | None, Callable[[dict, dict], None] | None]] = {}


def accept_absent_state(qualname: str, message: str | None,
                        complete: Callable[[dict, dict], None] | None = None) -> None:
    """A sharded checkpoint saved without this callback (fp8_guard added after a divergence)
    resumes with it starting empty. Composer's sharded load has torch.distributed.checkpoint fill
    the state every callback reports before fit (composer/utils/checkpoint.py,
    `load_sharded_checkpoint`: `state.state_dict()`), and DCP's default planner refuses a key
    the checkpoint lacks (torch/distributed/checkpoint/default_planner.py,
    `create_default_local_load_plan`); FSDP2Config has no load planner to set (its
    `load_planner` is a read-only None, composer/utils/parallelism.py). So Composer's
    `dist_cp_load`, which retries its own missing Adam key the same way, is wrapped once per
    process: the template leaves out what the checkpoint lacks of our callbacks' entries only;
    every other key stays as strict as before. `complete(entry, saved)`, given the checkpoint's
    keys of the entry (below its name) with DCP's metadata of each, adds to the template what the state before fit cannot
    know the checkpoint holds. A load refused only for Composer's tokenizer metadata is retried
    without it (`_without_integrations`)."""
    _ABSENT_OK[qualname] = (message, complete)
    from composer.utils import checkpoint

    load = getattr(checkpoint, "dist_cp_load", None)
    if load is None or getattr(load, "_foundry_fp8", False):
        return

    @functools.wraps(load)
    def dist_cp_load(state_dict: dict[str, Any], storage_reader: Any, *args: Any,
                     **kwargs: Any) -> Any:
        model = state_dict.get("state", {}).get("model")
        if isinstance(model, dict):
            _preparing(_drop_unsaved_extra_state, model, storage_reader)
        entries = state_dict.get("state", {}).get("callbacks")
        if isinstance(entries, dict) and entries.keys() & _ABSENT_OK.keys():
            _preparing(_prepare, entries, storage_reader)
        where = _checkpoint_location(storage_reader)
        try:
            return load(state_dict, storage_reader, *args, **kwargs)
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            if not _without_integrations(error, state_dict, where):
                _explain_integrations(error, where)
                raise
        return load(state_dict, storage_reader, *args, **kwargs)

    dist_cp_load._foundry_fp8 = True  # type: ignore[attr-defined]
    checkpoint.dist_cp_load = dist_cp_load


def _checkpoint_location(storage_reader: Any) -> str:
    """Where the user's sharded checkpoint is, as a load_path would name it. An object-store one
    is read through Composer's DistCPObjectStoreReader, whose `path` is only the download folder
    `<tempdir>/checkpoints`, deleted when the load ends (composer/utils/checkpoint.py,
    `load_sharded_checkpoint`, 0.31 and 0.32.1); its `source_path` is the object name in its
    `object_store`, whose `get_uri` gives the URI (what autoresume loads: composer/trainer/
    trainer.py, `ar_object_store.get_uri`)."""
    source = getattr(storage_reader, "source_path", None)
    if source is None:
        return str(getattr(storage_reader, "path", "the checkpoint"))
    try:
        return str(storage_reader.object_store.get_uri(source))
    except Exception:  # a LoggerDestination as the store has no get_uri
        return f"the remote checkpoint folder {source}"


#: DCP's refusal of a tokenizer key the sharded checkpoint lacks (default_planner.py,
#: `create_default_local_load_plan`)
_INTEGRATIONS_MISSING = re.compile(
    r"Missing key in checkpoint state_dict: (state\.integrations\..*)\.")
#: what that refusal is, where the user reads it: not foundry-fp8's, nor the FP8 state's. Composer
#: skips 'integrations' in State.load_state_dict (composer/core/state.py:1457-1459, 0.32.1) and
#: its autoresume drops load_ignore_keys (composer/trainer/trainer.py:1697); %s: the checkpoint
INTEGRATIONS_NOTE = (
    "foundry-fp8: not an FP8 problem: the run's tokenizer, before its first call, is saved "
    "differently from the one in this sharded checkpoint (a fast tokenizer keeps the "
    "truncation/padding of its last call in its tokenizer.json, as LLM-Foundry's text datasets "
    "call it; Composer puts that file in state.integrations and has DCP load it, though it never "
    "reads it back: composer/core/state.py, load_state_dict). Workaround: resume with "
    "autoresume: false, load_path: %s and load_ignore_keys: [state/integrations] "
    "(autoresume sets load_ignore_keys to None: composer/trainer/trainer.py, __init__)")


def _without_integrations(error: BaseException, state_dict: dict[str, Any], where: Any) -> bool:
    """A sharded load refused only for keys under state.integrations (Composer's tokenizer
    metadata, which it never reads back: composer/core/state.py:1457-1459 in 0.32.1, 1456 in
    0.31) drops them from the template, says so once, and is to be retried, as
    load_ignore_keys: [state/integrations] would, which autoresume cannot set. DCP refuses only
    the template's keys the checkpoint lacks (default_planner.py,
    `create_default_local_load_plan`, which iterates the template; the checkpoint's keys the
    template lacks are left unread), whichever tokenizer was called; a template that grew or
    lost keys elsewhere is still refused. Every rank gets the same gathered CheckpointException
    (checkpoint/utils.py, `_DistWrapper.reduce_scatter`), so all of them retry or none does."""
    from torch.distributed.checkpoint.api import CheckpointException

    state = state_dict.get("state")
    if not isinstance(error, CheckpointException) or not isinstance(state, dict) \
            or "integrations" not in state or not error.failures:
        return False
    refused = [_INTEGRATIONS_MISSING.match(str(failure)) for failure, _ in error.failures.values()]
    if not all(refused):
        return False
    del state["integrations"]
    log.warning("foundry-fp8: %s holds Composer's tokenizer metadata saved differently from this "
                "run's (it lacks %s: a fast tokenizer keeps its last call's truncation/padding "
                "in its tokenizer.json); loading it without state.integrations, as load_ignore_keys: "
                "[state/integrations] would: Composer never reads that entry back "
                "(composer/core/state.py, load_state_dict), so nothing of the model, optimizer or "
                "FP8 state is skipped", where, ", ".join(sorted({m.group(1) for m in refused if m})))
    return True


def _explain_integrations(error: BaseException, where: Any) -> None:
    """A sharded load refused for Composer's tokenizer metadata (seen with no foundry-fp8
    callback too) gets one line saying so and how to resume; the error itself is unchanged."""
    if not _INTEGRATIONS_MISSING.search(str(error)):
        return
    if hasattr(error, "add_note"):  # Python >= 3.11: printed under the error
        error.add_note(INTEGRATIONS_NOTE % where)
    else:
        log.error(INTEGRATIONS_NOTE, where)


def _preparing(step: Callable[[dict[str, Any], Any], None], template: dict[str, Any],
               storage_reader: Any) -> None:
    """One step preparing the sharded load's template; an error in it is our bug, said in one
    line, and Composer's load goes on as without us."""
    try:
        step(template, storage_reader)
    except Exception as error:
        log.warning("foundry-fp8: internal error preparing the sharded checkpoint load "
                    "(%s: %s); loading it as Composer does", type(error).__name__,
                    str(error).splitlines()[0][:200] if str(error) else "")


def _drop_unsaved_extra_state(model: dict[str, Any], storage_reader: Any) -> None:
    """Leave out of the model's load template the `_extra_state` keys the checkpoint lacks (a
    bf16 run's torch layers loaded into TE's, `fc_type: te`): DCP refuses them ('Missing key in
    checkpoint state_dict: state.model.<module>._extra_state'); the module then loads without
    one (fp8_state gives it the inert state, `te.extra_state.inert_when_missing_hook`; a
    non-strict load skips it; a strict one names it)."""
    saved = storage_reader.read_metadata().state_dict_metadata
    for key in [k for k in model if k.split(".")[-1] == EXTRA_STATE_SUFFIX
                and f"state.model.{k}" not in saved]:
        del model[key]


def _prepare(entries: dict[str, Any], storage_reader: Any) -> None:
    """Our callbacks' entries of the load template, completed and pruned to what the checkpoint
    holds; prepared on a copy, so a failure leaves the template untouched."""
    saved = storage_reader.read_metadata().state_dict_metadata
    where = _checkpoint_location(storage_reader)
    ours = sorted(n for n in entries.keys() & _ABSENT_OK.keys() if entries[n])
    prepared = {name: _containers_copy(entries[name]) for name in ours}
    said = []
    for name in ours:
        message, complete = _ABSENT_OK[name]
        if complete is not None and isinstance(prepared[name], dict):
            prefix = f"state.callbacks.{name}."
            complete(prepared[name], {k[len(prefix):]: v for k, v in saved.items()
                                      if k.startswith(prefix)})
        if _drop_unsaved(prepared, name, saved) and message is not None:
            said.append(message)
    for name in ours:
        if name in prepared:
            entries[name] = prepared[name]
        else:
            del entries[name]
    for message in said:
        log.warning(message, where)


def _containers_copy(value: Any) -> Any:
    """`value` with its dicts and lists copied, their leaves (tensors) shared."""
    if isinstance(value, dict):
        return {k: _containers_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_containers_copy(v) for v in value]
    return value


def _drop_unsaved(entries: dict[str, Any], name: str, saved: Iterable[str]) -> bool:
    """Leave out of `entries[name]` the values the checkpoint lacks (DCP's keys join dict keys
    with '.'), and dicts emptied so; True when the checkpoint holds nothing of the entry (then
    it is left out whole, and Composer does not call the callback's `load_state_dict`)."""
    prefix = f"state.callbacks.{name}"
    held = set()
    for key in saved:
        if key.startswith(prefix + "."):
            parts = key.split(".")
            held.update(".".join(parts[:i]) for i in range(4, len(parts) + 1))

    def prune(node: dict[str, Any], path: str) -> None:
        for key in list(node):
            here, value = f"{path}.{key}", node[key]
            if isinstance(value, dict) and value and here in held:
                prune(value, here)
                if not value:
                    del node[key]
            elif here not in held and value != {}:  # DCP loads nothing into an empty dict
                del node[key]

    entry = entries[name]
    if not held:
        del entries[name]
        return True
    if isinstance(entry, dict):
        prune(entry, prefix)
    return False
