"""`fp8_stats`: the Composer callback over FP8Monitor (`callbacks: {fp8_stats: {...}}`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from composer.core import Callback, State, TimeUnit
from composer.loggers import (
    ConsoleLogger,
    Logger,
    LoggerDestination,
    ProgressBarLogger,
)
from composer.utils import dist

from foundry_fp8.composer.destinations import (
    HPARAM_MAX_CHARS,
    ConsoleResend,
    FitEndKeys,
    capped,
    deliver,
    mlflow_accepted,
    mlflow_logging,
)
from foundry_fp8.composer.failures import device_failure
from foundry_fp8.composer.te_swap import run_recipe
from foundry_fp8.fp8_meta import canonical_modules
from foundry_fp8.health import INITIAL_SCALE, SPECS, Flag, RunMetrics, parse_key, plural, spec
from foundry_fp8.health.history import shown
from foundry_fp8.health.keys import HIGH_PRECISION, UNCAST, layer_order_params, short_layer
from foundry_fp8.health.raster import render_heatmap
from foundry_fp8.health.specs import known_first
from foundry_fp8.mlflow_facts import RACE, WORKAROUNDS, races
from foundry_fp8.monitor import (
    FP8Monitor,
    FP8MonitorError,
    NoLayersError,
    abort_unfinished,
    multi_rank,
    watches_for,
)
from foundry_fp8.numerics import STAT_KEYS
from foundry_fp8.options import MonitorConfig, Schedule, build
from foundry_fp8.paths import (
    DUMP_FILE,
    DUMP_FOLDER,
    DUMP_FOLDER_KEY,
    in_run_folder,
    say_repeated,
)
from foundry_fp8.recipe import step0_scaling
from foundry_fp8.te.debug import (
    TEDebugSession,
    layer_pattern,
    log_fp8_tensor_stats_config,
    te_debug_problem,
)

log = logging.getLogger(__name__)

Table = Mapping[tuple[str, str], Mapping[str, float]]
#: Per tensor name, the FP8 formats its rows were cast in at one logging step (None: not known,
#: a checkpoint of an earlier version).
StepFormats = dict[str, frozenset[str]] | None
#: One logging step as the heatmaps keep it: step, `heatmap_rows` and `StepFormats`.
Recent = tuple[int, dict[tuple[str, str], dict[str, float]], StepFormats]
#: W&B sections: one image per statistic under `fp8_heatmap/`, the table as `fp8_table`.
IMAGE_PREFIX = "fp8_heatmap/"
TABLE_NAME = "fp8_table"
#: The fit-end hyperparameter: the worst value per layer and tensor (`FitEndKeys`' name).
SUMMARY_KEY = "fp8/stats_summary"
#: Logging steps a heatmap shows (the latest ones): a readable width, bounded memory.
IMAGE_STEPS = 64
#: The layout of `FP8Stats.state_dict()` in checkpoints (an earlier version saved `{}`). Fields
#: added since (`heatmaps`, the monitor's `whatif_judged`) are optional: a checkpoint without
#: them resumes, its warning naming what they would have restored.
STATE_VERSION = 1
#: The earlier run's warnings a resumed run names again, at most.
RECALLED = 10
#: The most bytes of per-rank what-if state (`reduce_amax: false`, every rank's own amax
#: history) a checkpoint carries: world size x history length x watched tensors x 4 bytes.
WHATIF_RANKS_LIMIT = 64 << 20


def _is_rank_zero() -> bool:
    return dist.get_global_rank() == 0


def run_folder(state: State, logger: Logger) -> Path:
    """Where this run writes: the `jsonl` logger's folder (what `foundry-fp8 report` reads; its
    `path` is resolved on every rank, so every rank's files land there), else the run folder
    (`foundry_fp8.paths`: the parent of a local checkpoint `save_folder`, else
    `runs/<run_name>`)."""
    from foundry_fp8.composer.jsonl_logger import JSONLLogger, state_run_folder

    for destination in logger.destinations:
        if isinstance(destination, JSONLLogger) and destination.path is not None:
            return destination.path.parent
    return state_run_folder(state)


class FP8Stats(Callback):
    """FP8 health of every selected linear layer, every `interval` batches between `start` and
    `end` (and at `dump_steps`, where it also saves the tensors), pooled over ranks (a weight
    the same on every rank counts once: `monitor`) and logged by rank 0 at the batch's own step
    (the step of Composer's `loss/train/total` for that batch).
    Under gradient accumulation a step's statistics are those of all its micro-batches (a
    weight's, of its first cast in the step, as TE's debug API takes it).

    Keys it logs (`health.keys`), per logging step:

    - summary series, on every destination, console included: `fp8/<tensor>/worst_underflow_pct`,
      `fp8/<tensor>/worst_overflow_pct`, `fp8/<tensor>/worst_cos_sim`,
      `fp8/<tensor>/flagged_layers`, `fp8/<tensor>/nonfinite` and `fp8/flagged_layers` (an
      evaluation between a logging step and the console's next print no longer drops them
      there: `destinations.ConsoleResend`); the
      worst values and flag counts leave out the layers fp8_guard runs in high precision
      (`fallbacks`; its `fp8/guard/...` series report them) and the tensors no cast touches
      (dY under NVTE_BACKWARD_OVERRIDE: a per-layer what-if only), not the layers never
      converted, whose what-if numbers say what FP8 would do to them. A tensor's `worst_*` keys
      are left out at a step where no layer counts (delayed scaling's first cast at step 0,
      every layer in fallback, every layer's tensor NaN/Inf only: its `nonfinite` says so): a
      missing point on every sink, not a perfect-looking 1.0/0;
    - per-layer series `fp8_<stat>/<tensor>/<layer>` (W&B makes one section per statistic;
      `<layer>` without the `model.transformer.` prefix or wrapper segments), and
      `fp8_initial_scale/<tensor>/<layer>` = 1 on delayed scaling's first cast (of any
      rank's nonzero values: `reduce_amax: false` lets a rank cast at scale 1 later) and
      `fp8_uncast/<tensor>/<layer>` = 1 on a tensor its layer's FP8 run does not cast (dY
      under NVTE_BACKWARD_OVERRIDE), `fp8_high_precision/<tensor>/<layer>` = 1 on a row whose
      layer ran in high precision (te_swap left it out, or fp8_guard's fallback: what-if
      numbers): on every destination except the console unless `console_layers: true`;
    - with `te_debug`, TE's own statistics `fp8_te_<stat>/<tensor>/<layer>` (`<stat>` is TE's
      name, `_pct` for its `%`: `underflow_pct` for `underflows%`, `scale_inv_min`, ...;
      `te.debug.our_stat`), where the per-layer series go (a name MLflow still refuses stays
      out of MLflow alone: `destinations.mlflow_accepted`), of training forwards only (TE's
      debug is paused during evaluation and prediction) at TE iterations counted as
      Composer's batches, after a resume too;
    - every `image_interval` batches (at the first logging step from each multiple on) and at
      fit end (unless its last logging step's are shown): a layers x logging steps heatmap,
      `fp8_heatmap/<stat>`, per statistic whose `health.specs` plot is one (`underflow_pct`,
      `overflow_pct`, `rel_mse`, `cos_sim`; `nan_count`, `inf_count` once one is nonzero)
      (`Logger.log_images`, the last `IMAGE_STEPS` logging steps), and the per-layer table of
      the logging step, `fp8_table` (`Logger.log_table`; its `numbers` column says `FP8`,
      `what-if` or `what-if (fp8_guard fallback)`), off the console and out of the `jsonl`
      logger's file (it keeps metrics and hyperparameters); `null` turns them off;
    - at fit end the hyperparameter `fp8/stats_summary`, the worst value per layer and tensor
      (also printed whole; a tensor with what-if numbers at some judged step is marked
      `(what-if)`), cut to MLflow's 6000 characters; `fp8/stats_summary.ba<step>` after a
      resume or at a second fit's end (`destinations.FitEndKeys`: loggers refuse a changed
      value);
    - at FIT_START, where `dump_steps` are set, the hyperparameter `fp8/dump_folder`: the folder
      the dumps go to (`dump_record`), where `foundry-fp8 report` finds them from any sink;
    - at FIT_START, the hyperparameter `fp8/layers` (`health.keys.LAYER_ORDER`), to every
      logger but the console; a logger's refusal (a resume whose watched modules changed) is a
      warning, `strict` or not.

    `<tensor>` is the watched tensor's name: `activation` (the GEMM input), `weight`,
    `gradient` (the output gradient), and for TE's LayerNormMLP `fc1_weight` and `fc2_weight`
    (`monitor.watches_for`); TE's debug statistics name a LayerNormMLP's GEMMs' tensors
    `fc1_activation`, `fc2_weight`, ... (`te.debug.metric_name`; a name it cannot place is logged
    as `fp8/te_debug/<TE's name>`, `%` as `_pct`). The summary series cover every tensor name of the hooks'
    statistics (`fp8/fc1_weight/worst_underflow_pct`, ...); TE's debug statistics get none.

    Defaults: `layers: .*`, `tensors: [activation, weight, gradient]`, `interval: 100ba`,
    `image_interval: 1000ba`, `console_layers: false`. An MPT-1B (24 blocks x 4 linears x 3
    tensors) logs 16 summary series on the console and 3,456 per-layer series (288 x 12
    statistics; 288 more `fp8_initial_scale` under delayed scaling) elsewhere.

    At FIT_START rank 0 warns once per run where an MLflow logger writes asynchronously to a
    local file store with more than one writer thread: MLflow can then drop whole batches of
    metrics (`foundry_fp8.mlflow_facts`).

    Our own errors never stop training: the callback logs the error and switches itself off,
    unless `strict: true`. Under several ranks every rank switches off together, so that none
    is left waiting in a collective: a rank that fails logs its error and stays in step (joining
    the collectives with no statistics of its own) until the next logging step, whose all_reduce
    carries its failure flag and switches fp8_stats off on every rank (see FP8Monitor.fail); a
    failure to start at FIT_START is agreed on by one all_reduce there. `strict: true` raises on
    the failing rank instead: the job then dies, the other ranks being ended by the launcher.
    A logger destination that raises is not our error: it is warned once per destination and
    kind, every other destination still gets the values (`composer.destinations.deliver`), and
    fp8_stats goes on; `strict: true` raises once every destination has been tried.

    Resume is exact: the checkpoint carries this callback's state (`state_dict`; the health
    rules' streaks, warned rules and worst values, the what-if's delayed scales, the heatmaps'
    last `IMAGE_STEPS` logging steps), so a resumed run logs the series, heatmaps, table and
    summary of the uninterrupted run. A checkpoint without it, or of other layers, tensors or
    recipe, resumes with what fits and one warning.
    """

    def __init__(self, **options: Any):
        self.options = build("fp8_stats", options)  # one line naming callbacks.fp8_stats.<key>
        self.schedule: Schedule = self.options.schedule
        self.config: MonitorConfig = self.options.monitor
        self.dump_folder: str | None = self.options.dump_folder
        self.strict: bool = self.options.strict
        self.image_interval: int | None = self.options.image_interval
        self.console_layers: bool = self.options.console_layers
        self._recent: deque[Recent] = deque(maxlen=IMAGE_STEPS)  # for the heatmaps
        self._next_image: int
        self._imaged: int | None
        self._start_images()
        # destinations a table would hang (below), asked once per fit: W&B's `run.settings`
        # copies its settings at every read (about 15 ms)
        self._no_table: list[LoggerDestination] | None = None
        self.monitor: FP8Monitor | None = None
        self._restored: Mapping[str, Any] | None = None  # loaded before the monitor exists
        self._fit_started = False  # the same on every rank: FIT_START has run
        self._summary_keys = FitEndKeys(SUMMARY_KEY)
        #: The FIT_START hyperparameters this callback sent: a second fit() sends them again
        #: only where they changed (MLflow's asynchronous queue refuses a batch naming one key
        #: twice, "Duplicate parameter keys", and drops the losses queued with it)
        self._sent: dict[str, Any] = {}
        self._resend = ConsoleResend()  # what an evaluation kept off the console
        self._whatif_too_big_said = False
        self._mlflow_race_said = False
        #: our own failures that may recur at every logging step or checkpoint (`_say_failed`)
        self._failed_said: set[str] = set()
        self.disabled = False
        self._step = 0
        #: this fit has logged nothing yet and was not told so at FIT_START (`_say_unlogged`)
        self._unlogged = False
        self._judged_from = 0  # this fit's first step whose statistics can be judged
        self._step0_unjudged = False  # a fresh fit under delayed scaling (`_fit_start`)
        self._dumps_checked = False  # an earlier run's dumps looked for (`_say_replaced`): once
        self._dumps_to_check: tuple[Path, int | None] | None = None  # (folder, last batch)
        self._te_metrics: dict[str, float] = {}
        #: Layers fp8_guard runs in high precision now (names as in the keys), kept current by
        #: the guard: their what-if rows stay out of the summary series, and the table says so.
        self.fallbacks: frozenset[str] = frozenset()
        #: Called on every rank at each logging step with (step, table, flags): the pooled
        #: `{(layer, tensor): {stat: value}}` and the health flags raised (fp8_guard's input).
        self.listeners: list[Callable[[int, dict, dict], None]] = []
        self.te_debug = _start_te_debug(self.options.te_debug, self.config.layers,
                                        self.config.exclude, self.config.tensors, self.schedule,
                                        Path(self.options.te_debug_folder),
                                        self._te_metrics.__setitem__)

    def _unsent(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """Those of `params` this callback has not sent with the same value, now marked sent."""
        new = {k: v for k, v in params.items() if k not in self._sent or self._sent[k] != v}
        self._sent.update(new)
        return new

    # Composer's named events; each runs under `_guarded` (our error never stops training).

    def fit_start(self, state: State, logger: Logger) -> None:
        self._fit_started = True
        if self.disabled:
            return
        self._guarded(self._fit_start, state, logger)
        if multi_rank():
            # once per fit: a rank that could not build its monitor cannot join the steps'
            # collectives, so the ranks agree here on whether one failed
            failed = state.device.tensor_to_device(torch.tensor([float(self.disabled)]))
            dist.all_reduce(failed, reduce_operation="MAX")
            if failed.item() and not self.disabled:
                log.error("fp8_stats failed to start on another rank; disabling it here too")
                self.disabled = True

    def batch_start(self, state: State, logger: Logger) -> None:
        self._resend.resend("fp8_stats", self.strict)
        self._guarded(self._te_resume, state, logger)  # an evaluation that raised left it off
        self._guarded(self._batch_start, state, logger)

    def eval_start(self, state: State, logger: Logger) -> None:
        self._guarded(self._te_pause, state, logger)

    def eval_end(self, state: State, logger: Logger) -> None:
        self._guarded(self._te_resume, state, logger)

    def predict_start(self, state: State, logger: Logger) -> None:
        self._guarded(self._te_pause, state, logger)

    def predict_end(self, state: State, logger: Logger) -> None:
        self._guarded(self._te_resume, state, logger)

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._resend.resend("fp8_stats", self.strict)

    def before_train_batch(self, state: State, logger: Logger) -> None:
        self._guarded(self._before_train_batch, state, logger)

    def before_forward(self, state: State, logger: Logger) -> None:
        self._guarded(self._before_forward, state, logger)

    def after_train_batch(self, state: State, logger: Logger) -> None:
        self._guarded(self._after_train_batch, state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._resend.fit_end("fp8_stats", self.strict)
        self._guarded(self._fit_end, state, logger)

    def close(self, state: State, logger: Logger) -> None:
        """The Trainer is done: hooks a fit left armed (it raised mid-step, and Composer runs
        no event after that) come off the model, which something else may train next, and a
        TE debug session that no FIT_END ended is ended (the next run's would not start)."""
        del state, logger
        if self.monitor is not None:
            self.monitor.abort()
        if self.te_debug is not None:
            self.te_debug.close()

    def _guarded(self, work: Callable[[State, Logger], None], state: State,
                 logger: Logger) -> None:
        if self.disabled:
            return
        try:
            work(state, logger)
        except Exception as e:
            if self.strict:
                raise
            self._failed(e)

    def _failed(self, error: Exception) -> None:
        """Switch off now where every rank agrees (an FP8MonitorError, raised on every rank
        together; a single process; no monitor yet); else stay in step (see the class doc)."""
        if isinstance(error, NoLayersError):  # the user's `layers` regex, not our bug: one line
            log.warning("%s; fp8_stats is off for this run (strict: true makes this an error)",
                        error)
            self.disabled = True
            return
        if self.monitor is not None and multi_rank() and not isinstance(error, FP8MonitorError):
            log.exception("fp8_stats failed on this rank; every rank switches it off at the next "
                          "logging step (set strict: true to fail instead)")
            self.monitor.fail(error)
            return
        log.exception("fp8_stats failed; disabling it for the rest of the run "
                      "(set strict: true to fail instead)")
        if self.monitor is not None:
            self.monitor.abort()
        self.disabled = True

    def _start_images(self) -> None:
        """Images are due from `image_interval` on (none at the first logging steps, one column
        wide), and none shown yet (`_imaged`: the logging step the last images showed)."""
        self._next_image, self._imaged = self.image_interval or 0, None

    def _fit_start(self, state: State, logger: Logger) -> None:
        # first: said where the monitor then fails to build too (no layer matches), as fp8_lint
        # leaves FP8051 to this warning (`composer.lint.SAID_BY_THE_RUN`)
        if not self._mlflow_race_said and _is_rank_zero() \
                and any(mlflow_races(d, os.environ) for d in logger.destinations):
            self._mlflow_race_said = True  # once per run: a second fit changes nothing
            log.warning("fp8_stats: %s; %s", RACE, WORKAROUNDS)
        self._summary_keys.fit_start(int(state.timestamp.batch))
        if abort_unfinished():  # an earlier fit's, which raised mid-step: no event since
            log.info("fp8_stats: an earlier fit that raised mid-step left its statistics hooks "
                     "armed on the model; taken off")
        self.monitor = None  # until built: a rank that fails here cannot join collectives
        self._no_table = None
        config = self.config
        key, base = "callbacks.fp8_stats.dump_folder", run_folder(state, logger)
        if self.dump_folder and _is_rank_zero():  # the key the YAML wrote, said once, dumps
            # or none: fp8_lint leaves FP8052 to the run (`composer.lint.SAID_BY_THE_RUN`)
            say_repeated(self.dump_folder, base, state.run_name, key)
        dumps = None
        if self.schedule.dump_steps:
            dumps = in_run_folder(self.dump_folder or DUMP_FOLDER, base, state.run_name, key)
            config = dataclasses.replace(config, dump_folder=dumps)
        self.monitor = FP8Monitor(state.model, config, schedule=self.schedule,
                                  on_warning=log.warning if _is_rank_zero() else lambda _: None,
                                  passes=device_failure if auto_retries(state) else None)
        if _is_rank_zero():
            # the model's order of the layers it may watch, for the report (W&B and MLflow keep
            # no order of keys): every such layer, so that a resume with other `layers` logs the
            # same value. Not to the console (its yaml.dump at fit start would print a line per
            # layer), and never stopping a run, strict or not: a resume whose modules changed
            # (te_swap's fuse_ln_mlp) logs another value, which MLflow and W&B refuse
            order = layer_order_params([short_layer(name) for name, module in canonical_modules(
                state.model) if watches_for(module) is not None], HPARAM_MAX_CHARS)
            if order := self._unsent(order):
                deliver([d for d in logger.destinations if not _console(d)], "hyperparameters",
                        lambda d: d.log_hyperparameters(order), "fp8_stats")
        if dumps is not None and _is_rank_zero():  # where the report finds them, every sink
            if record := self._unsent({DUMP_FOLDER_KEY: dump_record(dumps, base)}):
                deliver(logger.destinations, "hyperparameters",
                        lambda d: d.log_hyperparameters(record), "fp8_stats", self.strict)
        log.info("fp8_stats watches %d layers", len(self.monitor.layers))
        if (not self._restored and int(state.timestamp.batch) > 0
                and getattr(state, "fsdp_sharded_state_dict_enabled", False)):
            self._restored = None
            if _is_rank_zero():
                log.warning("fp8_stats: a sharded checkpoint (state_dict_type: sharded) brings "
                            "no fp8_stats state back through Composer's load; the summary, "
                            "health streaks and what-if scales start afresh at this resume")
        self._restore()  # Composer loads a checkpoint in the Trainer's constructor, before this
        if self._recent and int(state.timestamp.batch) <= self._recent[-1][0]:
            # the steps start again: fit(reset_time=True), or a checkpoint loaded with
            # `load_ignore_keys: [state/timestamp]`. So do the heatmaps and their due steps (the
            # earlier steps would share their numbers, and the last image step, compared by
            # number, left this fit without images until the earlier run's step count)
            self._recent.clear()
            self._start_images()
        if self.te_debug is not None:
            self.te_debug.name_layers(canonical_modules(state.model))
            self.te_debug.resume()
            # TE's debug iteration counts from 0; a resume (or reset_time) starts elsewhere
            self.te_debug.start_at(int(state.timestamp.batch))
        last, at = last_batch(state), int(state.timestamp.batch)
        # delayed scaling (te_swap's or Composer's recipe, else the what-if's) casts a fresh
        # run's step 0 at its initial scale 1 (no amax recorded yet): a logging step there
        # judges nothing, so it does not count
        # (a State driven by hand, outside a Trainer, may have no algorithms or precision)
        scaling = step0_scaling(run_recipe(state) if hasattr(state, "precision") else None,
                                config.recipe)  # type: ignore[arg-type]
        self._step0_unjudged = at == 0 and scaling == "delayed"
        self._judged_from = at + self._step0_unjudged
        first = self.schedule.next_log(self._judged_from - 1)
        # a duration Composer counts otherwise (tokens, samples) is judged at FIT_END
        self._unlogged = True
        if last is not None and (first is None or first > last):
            self._unlogged = False  # said now
            if _is_rank_zero():
                self._say_unlogged(last, ended=False)
        if dumps is not None and at == 0 and not self._dumps_checked:
            # before the first dump is written: the jsonl logger sets an earlier run aside at
            # rank 0's FIT_START, after the other callbacks' (composer/core/engine.py), and no
            # barrier follows before BATCH_START; the batch's forward and backward collectives do
            self._dumps_checked, self._dumps_to_check = True, (dumps, last)

    def _say_unlogged(self, last: int, ended: bool) -> None:
        """No logging step in this fit that judges anything: said at FIT_START where its last
        batch is known (`last_batch`), else at FIT_END, where it was silent before
        (`max_duration` in tokens or samples: no series, no summary, no word). Under delayed
        scaling a fresh run's step 0 alone judges nothing (`_judged_from`): every row of the
        summary ended "Never judged", with no word before."""
        initial = self._step0_unjudged and self.schedule.next_log(-1) == 0
        log.warning("fp8_stats: %s%s (it %s after batch %d; interval %s, start %d, end %s): lower "
                    "callbacks.fp8_stats.interval or start to see FP8 statistics",
                    "this run logged no FP8 statistics" if ended else "no logging step in this run",
                    " but step 0, which delayed scaling casts with its initial scale 1 (no amax "
                    "recorded yet), so no layer is judged" if initial else "",
                    "ended" if ended else "ends", last, self.schedule.interval,
                    self.schedule.start, self.schedule.end)

    def _te_pause(self, state: State, logger: Logger) -> None:
        """Evaluation and prediction forwards stay out of TE's statistics: TE's debug API feeds
        them into the training step's (`TEDebugSession.pause`)."""
        if self.te_debug is not None:
            self.te_debug.pause()

    def _te_resume(self, state: State, logger: Logger) -> None:
        if self.te_debug is not None:
            self.te_debug.resume()

    def _batch_start(self, state: State, logger: Logger) -> None:
        if self.monitor is not None:
            self._step = int(state.timestamp.batch)
            self.monitor.start_step(self._step)

    def _before_train_batch(self, state: State, logger: Logger) -> None:
        if self.monitor is not None:  # an OOM retry starts over
            self.monitor.restart_batch()

    def _before_forward(self, state: State, logger: Logger) -> None:
        # once per micro-batch, before its precision context (composer trainer.py:2921-2923):
        # every micro-batch's tensors count, as every rank's do
        if self.monitor is not None:
            self.monitor.next_microbatch()

    def _after_train_batch(self, state: State, logger: Logger) -> None:
        """The batch's forward and backward are done (every micro-batch) and Composer has not
        yet logged its loss: logged now at the batch's own step, the step of its
        `loss/train/total`, they land in W&B. At BATCH_END other callbacks have already logged
        at the next step, and W&B drops a step lower than one it has seen."""
        if self.monitor is None:
            return
        if self._dumps_to_check is not None and self.monitor.dumping:
            (dumps, last), self._dumps_to_check = self._dumps_to_check, None
            _say_replaced(dumps, self.schedule.dump_steps, last,  # type: ignore[arg-type]
                          state.run_name)
        metrics = self.monitor.finish_step(self.fallbacks)  # raises only on every rank together
        # not `if metrics`: a rank whose own work failed after the pooling has none, and a
        # listener's collective (the guard's vote) left out there pairs with another one
        if self.monitor.pooled:
            for listener in self.listeners:  # the pooled table as judged, and flags, on every
                # rank: a tensor no FP8 cast touches (NVTE_BACKWARD_OVERRIDE's dY) moves no layer
                listener(self._step, self.monitor.judged, self.monitor.flags)
        te_metrics: dict[str, float] = {}
        if self.te_debug is not None:
            self.te_debug.step()  # TE logs the finished step's stats into _te_metrics
            te_metrics = dict(self._te_metrics)
            self._te_metrics.clear()
        if metrics:
            self._unlogged &= self._step < self._judged_from
            self._recent.append((self._step, marked(heatmap_rows(self.monitor.table), {
                HIGH_PRECISION: self.monitor.high_rows | self.monitor.fallback_rows,
                UNCAST: self.monitor.uncast_rows}),
                                 step_formats(self.monitor.formats)))
        dumped, self.monitor.dumped = self.monitor.dumped, []
        if not _is_rank_zero():
            return
        for path, count in dumped:  # the file the user asked for, named as it is written
            print(f"foundry_fp8 fp8_stats: step {self._step}'s {count} tensor"
                  f"{'' if count == 1 else 's'} saved to {path}, each with its scale (each rank "
                  "writes its own; the file's metadata says what each tensor is)", flush=True)
        if metrics or te_metrics:
            self._rank_zero(lambda: self._log_metrics(logger, metrics, te_metrics),
                            "logging the metrics")
        if metrics and self.image_interval is not None and self._step >= self._next_image:
            self._next_image = (self._step // self.image_interval + 1) * self.image_interval
            self._rank_zero(lambda: self._log_pictures(logger, self._step),
                            "logging the images and table")

    def _log_metrics(self, logger: Logger, metrics: Mapping[str, float],
                     te_metrics: Mapping[str, float]) -> None:
        """The summary series everywhere; the per-layer ones (and TE's) off the console unless
        `console_layers`: thousands of lines at MPT-1B scale."""
        summary = {k: v for k, v in metrics.items() if parse_key(k) is None}
        layers = {**{k: v for k, v in metrics.items() if parse_key(k) is not None}, **te_metrics}
        step = self._step

        def send(destination: LoggerDestination) -> None:
            shown = summary if _console(destination) and not self.console_layers else {
                **summary, **layers}
            shown = mlflow_accepted(destination, shown, "fp8_stats")
            if shown:
                destination.log_metrics(shown, step)
                self._resend.sent(destination, shown, step)

        deliver(logger.destinations, "metrics", send, "fp8_stats", self.strict)

    def _log_pictures(self, logger: Logger, step: int) -> None:
        """The heatmaps of the last logging steps and the last logging step's per-layer table,
        through Composer's Logger API (W&B shows them natively), to every destination but the
        console (which would print the table as JSON at every line after)."""
        assert self.monitor is not None
        run = RunMetrics()
        for logged, table, _ in self._recent:
            run.add_table(logged, table)
        formats = shown_formats(formats for _, _, formats in self._recent)
        destinations = [d for d in logger.destinations if not _console(d)]
        for stat in run.stats:
            if spec(stat).plot == "heatmap" and shown(run, stat):
                image = render_heatmap(run, stat, self.monitor.tracker.thresholds, formats)
                deliver(destinations, "images",
                        lambda d, image=image, stat=stat: d.log_images(
                            image, f"{IMAGE_PREFIX}{stat}", True, step, use_table=False),
                        "fp8_stats", self.strict)
        columns, rows = table_rows(self._recent[-1][0] if self._recent else step,
                                   self.monitor.table, self.monitor.flags,
                                   self.monitor.whatif_rows, self.monitor.fallback_rows)
        if self._no_table is None:
            self._no_table = [d for d in destinations if _wandb_table_hangs(d)]
            if self._no_table:
                log.warning(WANDB_OFFLINE_TABLE)
        deliver([d for d in destinations if d not in self._no_table], "table",
                lambda d: d.log_table(columns, rows, TABLE_NAME, step), "fp8_stats", self.strict)
        self._imaged = self._recent[-1][0] if self._recent else None

    def _fit_end(self, state: State, logger: Logger) -> None:
        if self.monitor is None:
            return
        if self.te_debug is not None:
            self.te_debug.close()
        if not _is_rank_zero():
            return
        if self._unlogged:
            self._say_unlogged(int(state.timestamp.batch) - 1, ended=True)
        if (self.image_interval is not None and self._recent
                and self._imaged != self._recent[-1][0]):
            # the run's end, at the step W&B is at now (the batch count after the last batch)
            self._rank_zero(lambda: self._log_pictures(logger, int(state.timestamp.batch)),
                            "logging the images and table")
        summary = self.monitor.summary()
        if summary:
            print(f"foundry_fp8 fp8_stats: worst value per layer and tensor\n{summary}",
                  flush=True)
            key = self._summary_keys.key(int(state.timestamp.batch))
            value = capped(summary, "the whole table is printed at fit end; `foundry-fp8 "
                                    "report` shows every layer")
            deliver(logger.destinations, "hyperparameters",
                    lambda d: d.log_hyperparameters({key: value}), "fp8_stats", self.strict)

    # checkpoint state: Composer saves `state_dict()` in every checkpoint (every rank calls it)
    # and calls `load_state_dict` when it loads one, after INIT and before FIT_START

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state (tracker and what-if, `FP8Monitor.state_dict`; the same on every
        rank: both follow the pooled statistics and the all_reduced amaxes), when images are
        next due and the heatmaps' history (`_recent`, at most `IMAGE_STEPS` logging steps of
        the pooled tables, with the formats of their rows for the titles: saved by each rank
        without a collective). Under
        `reduce_amax: false` each rank's what-if is gathered too. A failure of ours saves
        `unsaved` instead of stopping the save (`strict`: raises)."""
        if not self._fit_started:
            # Composer asks for it in the Trainer's constructor too, as the template a sharded
            # checkpoint is loaded into: there a key the checkpoint lacks is an error, so the
            # template holds nothing of ours (that load then restores nothing: `_fit_start`)
            return dict(self._restored) if self._restored is not None else {}
        saved: dict[str, Any] = {"version": STATE_VERSION}
        try:
            if self.monitor is not None:
                saved["monitor"] = self.monitor.state_dict()
                saved["images"] = [self.image_interval, self._next_image]
                saved["heatmaps"] = [
                    [step, [[layer, tensor, dict(stats)]
                            for (layer, tensor), stats in rows.items()],
                     None if formats is None else {t: sorted(f) for t, f in formats.items()}]
                    for step, rows, formats in self._recent]
        except Exception as e:
            if self.strict:
                raise
            self._say_failed("reading its state to save", e, "this checkpoint holds none (a "
                             "resume from it starts the summary and streaks afresh)")
            saved = {"version": STATE_VERSION, "unsaved": True}
        recipe = self.config.recipe
        if multi_rank() and recipe.scaling == "delayed" and not recipe.reduce_amax:
            # every rank joins the gather, whatever its own state; each rank's what-if goes
            # into every checkpoint, so only while all of them stay small
            mine = self._local_whatif()
            # decided from every rank's size (one small gather): a rank that skipped the
            # gather below while another joined it would hang them both
            size = sum(dist.all_gather_object(_whatif_bytes(mine)))
            if size <= WHATIF_RANKS_LIMIT:
                ranks = dist.all_gather_object(mine)
                if any(r is not None for r in ranks):
                    saved["whatif_ranks"] = ranks
            elif not self._whatif_too_big_said and _is_rank_zero():
                self._whatif_too_big_said = True
                log.warning("fp8_stats: the per-rank what-if scales (reduce_amax: false) take "
                            "%d MiB over %d ranks, over %d MiB: checkpoints leave them out, "
                            "and a resume starts them afresh", size >> 20,
                            dist.get_world_size(), WHATIF_RANKS_LIMIT >> 20)
        return saved

    def _local_whatif(self) -> dict[str, Any] | None:
        if self.monitor is None or self.disabled:
            return None
        try:
            return self.monitor.whatif_state()
        except Exception as e:
            self._say_failed("reading this rank's what-if state", e, "not saved")
            return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Kept until the monitor exists (FIT_START), applied then; at once if it does."""
        self._restored = state
        if self.monitor is not None:
            self._restore()

    def _restore(self) -> None:
        """Apply the loaded state; what does not fit is said in one line and left out, and a
        state we cannot read leaves the statistics fresh (`strict`: raises)."""
        state, self._restored = self._restored, None
        if state is None or self.monitor is None:
            return
        say = log.warning if _is_rank_zero() else (lambda *_: None)
        try:
            notes = self._apply(state, self.monitor)
        except Exception as e:
            if self.strict:
                raise
            say("fp8_stats: the checkpoint's fp8_stats state is not usable (%s); the summary, "
                "health streaks and what-if scales start afresh at this resume", e)
            return
        if notes is None:
            say("fp8_stats: the checkpoint holds no fp8_stats state (saved by an earlier "
                "version); the summary, health streaks and what-if scales start afresh at this "
                "resume")
        elif notes:
            say("fp8_stats: resumed from the checkpoint without %s", "; ".join(notes))
        warned = self.monitor.tracker.warned
        if warned:  # this log (or W&B run) may be new: name what the earlier run warned about
            shown = [f"{layer} {tensor} {rule}" for layer, tensor, rule in warned[:RECALLED]]
            more = f", and {len(warned) - RECALLED} more" if len(warned) > RECALLED else ""
            say("fp8_stats: resumed; warned before the checkpoint, not repeated: %s%s",
                ", ".join(shown), more)

    def _apply(self, state: Mapping[str, Any], monitor: FP8Monitor) -> list[str] | None:
        """What was left out, in words; None: the checkpoint holds no state of ours."""
        if not state or "version" not in state:
            return None
        if state["version"] != STATE_VERSION:
            raise ValueError(f"version {state['version']!r}; this one reads {STATE_VERSION}")
        if state.get("unsaved"):
            raise ValueError("it could not be read when the checkpoint was saved")
        saved = state.get("monitor")
        if saved is None:  # fp8_stats was off in that run: nothing to go on from
            return []
        # checked before anything changes; the rows watched now, as the monitor's state
        heatmaps = _heatmap_history(state.get("heatmaps"), {
            (monitor.short[layer], tensor) for layer, tensor in monitor.rows})
        notes: list[str] = []
        ranks = state.get("whatif_ranks")
        if ranks is not None:  # reduce_amax: false, each rank its own what-if
            if len(ranks) == dist.get_world_size():
                saved = {**saved, "whatif": ranks[dist.get_global_rank()]}
            else:
                saved = {**saved, "whatif": None}
                notes.append(f"the what-if's delayed scales (saved per rank by {len(ranks)} "
                             f"ranks, this run has {dist.get_world_size()}), which start afresh")
        notes[:0] = monitor.load_state_dict(saved)
        images = state.get("images")
        if isinstance(images, list) and len(images) == 2 and images[0] == self.image_interval:
            self._next_image = int(images[1])
        if heatmaps is None:
            notes.append("the heatmaps' logging steps before it (the heatmaps start at this "
                         "resume)")
        else:
            self._recent.clear()
            self._recent.extend(heatmaps)
        return notes

    def _rank_zero(self, call: Callable[[], None], what: str) -> None:
        """What rank 0 alone does (logging): a failure there (a logger's is warned by `deliver`,
        which goes on with the other loggers) is logged and the statistics go on, so that the
        other ranks are not left in the next all_reduce; `strict: true` raises."""
        try:
            call()
        except Exception as e:
            if self.strict:
                raise
            self._say_failed(what, e, "the statistics go on")

    def _say_failed(self, what: str, error: Exception, outcome: str) -> None:
        """Our own failure at `what`, which is tried again at each logging step or checkpoint:
        said once (with its traceback), later ones at debug level, not one traceback per
        step."""
        if what in self._failed_said:
            log.debug("fp8_stats: %s failed again: %r", what, error)
            return
        self._failed_said.add(what)
        log.error("fp8_stats: %s failed on rank %d (%s: %s); %s (said once: later failures of "
                  "it are not reported; strict: true makes it an error)", what,
                  dist.get_global_rank(), type(error).__name__, error, outcome, exc_info=error)


def last_batch(state: State) -> int | None:
    """The batch count at which this fit's last batch starts (`max_duration` in batches, or in
    epochs of a sized dataloader), None where Composer's duration is counted otherwise."""
    duration, batches = (getattr(state, key, None) for key in ("max_duration", "dataloader_len"))
    if duration is None:
        return None
    if duration.unit == TimeUnit.BATCH:
        return duration.value - 1
    if duration.unit == TimeUnit.EPOCH and batches is not None:
        return duration.value * batches.value - 1
    return None


def auto_retries(state: State) -> bool:
    """Whether Composer runs a batch again after out of memory (or reports a CUDA error) raised
    in a hook of ours: under `device_train_microbatch_size: auto` (composer trainer.py
    `_train_batch`: it halves the micro-batch; the retry's statistics start afresh at
    BEFORE_TRAIN_BATCH). Kept by the hook, the error went unseen: the batch went on at the size
    that did not fit and fp8_stats switched off for the run. With a fixed size no retry helps:
    the error stays ours (fp8_stats off, training goes on)."""
    return bool(getattr(state, "auto_microbatching", False))


def _say_replaced(dumps: Path, steps: Iterable[int], last: int | None, run_name: str) -> None:
    """A fresh run's dumps replace an earlier run's of the same steps in `dumps`, unless the
    jsonl logger moved those aside with that run's records (`jsonl_logger._dumps_aside`; not
    without it, nor for a folder outside the run folder, nor for another node's local folder):
    said by each rank of its own files, before its first dump is written."""
    rank = dist.get_global_rank()
    found = [path for step in sorted(set(steps)) if last is None or step <= last
             if (path := dumps / DUMP_FILE.format(step=step, rank=rank)).is_file()]
    if found:
        log.warning("fp8_stats: %s holds %s of an earlier run (%s%s) that this run, named %r "
                    "and starting at batch 0, writes again: %s replaced. Only where the jsonl "
                    "logger moves the earlier run's records aside are its dumps moved with "
                    "them; give this run its own run_name or callbacks.fp8_stats.dump_folder "
                    "to keep them", dumps, plural(len(found), "dump"), found[0].name,
                    ", ..." if len(found) > 1 else "", run_name,
                    "it will be" if len(found) == 1 else "they will be")


def dump_record(dumps: Path, base: Path) -> str:
    """`DUMP_FOLDER_KEY`'s value: the dump folder relative to `base` (`run_folder`: the jsonl
    logger's folder, else the run folder), POSIX-style, so that it holds wherever the run
    folder is copied; absolute where the dumps lie outside it (an absolute `dump_folder`)."""
    for folder in (base, base.absolute()):
        if dumps.is_relative_to(folder):
            return dumps.relative_to(folder).as_posix()
    return dumps.absolute().as_posix()


def mlflow_races(destination: LoggerDestination, environ: Mapping[str, str]) -> bool:
    """Whether this destination is a Composer MLflow logger that can lose batches to MLflow's
    file-store race (`foundry_fp8.mlflow_facts`); `tracking_uri` is set where it logs."""
    return mlflow_logging(destination) and races(
        getattr(destination, "tracking_uri", None), bool(destination.synchronous), environ)


def _console(destination: LoggerDestination) -> bool:
    """Composer's console destinations: the ConsoleLogger and `progress_bar: true`'s
    ProgressBarLogger, which also yaml-dumps every hyperparameter at its fit start (one line per
    layer of `fp8/layers`) and shows only `metric`/`loss` keys."""
    return isinstance(destination, ConsoleLogger | ProgressBarLogger)


WANDB_OFFLINE_TABLE = (
    "fp8_stats: the per-layer table is not sent to W&B: this run is offline with W&B's "
    "allow_offline_artifacts on (its default), and then logging a table asks the W&B server "
    "for its version first (wandb 0.18, data_types/base_types/wb_value.py), retrying for as "
    "long as there is no network. Set loggers.wandb.init_kwargs.settings.allow_offline_artifacts:"
    " false to get the table (the heatmaps and series are sent either way)")


def _wandb_table_hangs(destination: LoggerDestination) -> bool:
    """Whether a table logged to this W&B destination would wait on the network (above)."""
    from composer.loggers import WandBLogger

    if not isinstance(destination, WandBLogger):
        return False
    import wandb

    settings = getattr(wandb.run, "settings", None)
    return bool(settings is not None and settings._offline
                and getattr(settings, "allow_offline_artifacts", False))


#: The per-row markers the heatmaps draw (delayed scaling's first cast: grey; fp8_guard's
#: high precision and a tensor not cast: hatched), kept with their statistics and in
#: checkpoints.
MARKERS = (INITIAL_SCALE, HIGH_PRECISION, UNCAST)


def heatmap_rows(table: Table) -> dict[tuple[str, str], dict[str, float]]:
    """What the heatmaps need of one logging step's table: their statistics and the markers
    (`MARKERS`; kept for `IMAGE_STEPS` steps, so only these)."""
    return {key: {stat: value for stat, value in stats.items()
                  if stat in MARKERS or spec(stat).plot == "heatmap"}
            for key, stats in table.items()}


def marked(rows: dict[tuple[str, str], dict[str, float]],
           marks: Mapping[str, Collection[tuple[str, str]]]) -> dict[tuple[str, str], dict[str, float]]:
    """`rows` with each marker's rows marked 1 (`HIGH_PRECISION`: the monitor's `high_rows` and
    `fallback_rows`, `UNCAST`: its `uncast_rows`; what-if numbers), which the heatmaps hatch as the report's do."""
    for marker, keys in marks.items():
        for key in keys:
            if key in rows:
                rows[key][marker] = 1.0
    return rows


#: The table's `numbers` column: the layer's own FP8 casts, or the `recipe` what-if of a layer
#: not in FP8 (never converted, or in fp8_guard's fallback: then out of the summary series).
FP8_NUMBERS, WHATIF_NUMBERS, FALLBACK_NUMBERS = "FP8", "what-if", "what-if (fp8_guard fallback)"


def step_formats(formats: Mapping[tuple[str, str], str]) -> dict[str, frozenset[str]]:
    """Per tensor name, the FP8 formats of its rows at one logging step (the monitor's
    `formats`)."""
    by_tensor: dict[str, set[str]] = {}
    for (_, tensor), name in formats.items():
        by_tensor.setdefault(tensor, set()).add(name)
    return {tensor: frozenset(names) for tensor, names in by_tensor.items()}


def shown_formats(steps: Iterable[StepFormats]) -> dict[str, frozenset[str]]:
    """Per tensor name, the formats over the logging steps a heatmap shows; none at all where
    one step's are not known (no format rather than a wrong one)."""
    shown: dict[str, frozenset[str]] = {}
    for formats in steps:
        if formats is None:
            return {}
        for tensor, names in formats.items():
            shown[tensor] = shown.get(tensor, frozenset()) | names
    return shown


def table_rows(step: int, table: Table, flags: Mapping[tuple[str, str], Sequence[Flag]],
               whatif: Collection[tuple[str, str]], fallback: Collection[tuple[str, str]],
               ) -> tuple[list[str], list[list[Any]]]:
    """The per-layer table of the logging step `step`: the step (the table is logged at later
    steps too: at fit end, W&B's step is already past the last logging step), layer, tensor,
    whose numbers they are (`whatif` rows, of which `fallback` ones are in the guard's
    fallback), each statistic, and the rules it broke there with the YAML key to change
    (`rule: key; ...`)."""
    stats = known_first({stat for row in table.values() for stat in row}, SPECS)

    def numbers(key: tuple[str, str]) -> str:
        return (FALLBACK_NUMBERS if key in fallback else WHATIF_NUMBERS if key in whatif
                else FP8_NUMBERS)

    rows = [[step, layer, tensor, numbers((layer, tensor)),
             *(row.get(stat, float("nan")) for stat in stats),
             "; ".join(f"{flag.rule}: {flag.yaml_key}" for flag in flags.get((layer, tensor), ()))]
            for (layer, tensor), row in table.items()]
    return ["step", "layer", "tensor", "numbers", *stats, "flags"], rows


def _start_te_debug(scaling: str | None, layers: str, exclude: str | None,
                    tensors: Sequence[str], schedule: Schedule, folder: Path,
                    sink: Callable[[str, float], None]) -> TEDebugSession | None:
    """TE's own statistics on the tensors TE casts (`te_debug: delayed|current`, the training
    recipe's scaling, which decides what TE can compute). Started here, in the constructor:
    TE's debug API must exist before the first TE module, and LLM-Foundry builds callbacks
    before the model."""
    if scaling is None:
        return None
    problem = te_debug_problem()
    if problem is not None:
        raise RuntimeError(f"{MonitorConfig.PATH}.te_debug: {problem}")
    config = log_fp8_tensor_stats_config(layer_pattern(layers, exclude), tensors,
                                         schedule.interval, scaling, start_step=schedule.start,
                                         end_step=schedule.end)
    session = TEDebugSession(config, folder, lambda name, value, step: sink(name, value))
    session.start()
    return session


def _heatmap_history(saved: Any, watched: Collection[tuple[str, str]]) -> list[Recent] | None:
    """`state_dict()`'s `heatmaps` read back, as `heatmap_rows` of the rows in `watched` (the
    rest are not drawn now) with each step's formats (not known from a checkpoint that has
    none); None when the checkpoint has no heatmaps (an earlier version). ValueError when
    malformed."""
    if saved is None:
        return None
    known = {*STAT_KEYS, *MARKERS}

    def formats(step: Sequence[Any]) -> StepFormats:
        if len(step) == 2 or step[2] is None:
            return None
        return {str(tensor): frozenset(map(str, names)) for tensor, names in step[2].items()}

    try:
        return [(int(step[0]), heatmap_rows({(layer, tensor): {stat: float(value)
                                                               for stat, value in stats.items()
                                                               if stat in known}
                                             for layer, tensor, stats in step[1]
                                             if (layer, tensor) in watched}), formats(step))
                for step in saved][-IMAGE_STEPS:]
    except (TypeError, ValueError, AttributeError, IndexError) as e:
        raise ValueError(f"not fp8_stats' heatmap history ({type(e).__name__}: {e})") from e


def _whatif_bytes(whatif: Mapping[str, Any] | None) -> int:
    """The size of one rank's what-if tensors (0 when it has none)."""
    if whatif is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (whatif["history"], whatif["scale"]))
