"""`foundry-fp8 report RUN_FOLDER`: reads the run, replays its logging steps through the same
health rules `fp8_stats` warned with, draws the plots and writes fp8_report.md. Bad input is one
line and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import errno
import io
import math
import os
import re
import sys
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import regex

from foundry_fp8.filters import MATCH_TIMEOUT_S, search
from foundry_fp8.guard import static_yaml
from foundry_fp8.health import Flag, HealthTracker, RunMetrics, plural, render_table
from foundry_fp8.health.history import shown
from foundry_fp8.health.keys import LOSS, full_forms, layer_order
from foundry_fp8.health.loss import LossComparison, LossSpike, compare, spike
from foundry_fp8.health.plots import (
    MAX_SERIES_LAYERS,
    choose_layers,
    draw_heatmap,
    draw_series,
    save_png,
)
from foundry_fp8.health.rules import model_blocks
from foundry_fp8.health.specs import badness, spec
from foundry_fp8.health.table import (
    bounded,
    distinct_labels,
    elide,
    one_line,
    short_names,
    table_order,
)
from foundry_fp8.health.thresholds import LOSS_GAP_STEPS, MAX_LOSS_GAP
from foundry_fp8.jsonl import check_writable, hparams_of, write_output
from foundry_fp8.options import OptionError
from foundry_fp8.report.baseline import (
    Baseline,
    mlflow_holes,
    no_loss,
    other_batches,
    read_baseline,
    read_config,
    same_run,
)
from foundry_fp8.report.markdown import (
    ALREADY_OUT,
    EXCLUDE_TOGETHER,
    EXCLUDE_TOGETHER_HELD,
    TO_FP8,
    Finding,
    WorstTable,
    change_key,
    departure,
    excluded_together,
    fallback_steps,
    findings,
    first_flagged,
    first_flags,
    flagged_whole,
    fp8_layers,
    grouped,
    guard_advice,
    in_high_precision,
    kept_out,
    layer_names,
    layers_named,
    moved,
    not_converted,
    nothing_judged,
    refused,
    render_report,
    runs_in_fp8,
    spike_line,
    unrecorded_fallbacks,
    values_said,
    worst_table,
)
from foundry_fp8.report.mlflow_run import (
    MlflowRun,
    load_mlflow,
    mlflow_history,
    mlflow_run,
    run_folder_of,
)
from foundry_fp8.report.read import (
    GuardRun,
    GuardSeries,
    NoStatistics,
    ReportError,
    dump_of,
    dump_places,
    formats_from_hparams,
    guard_run,
    in_model_order,
    load_run,
    load_wandb,
    losses_of,
    mark_high_precision,
    metrics_file_of,
    read_hparams,
    recipes_from_hparams,
    swap_filters,
    thresholds_from_hparams,
    wandb_files,
)

SERIES_FILE = "fp8_timeseries.png"
MAX_PRINTED = 10  # flagged rows on the terminal; the markdown has them all
#: The terminal's worst-value table: whole up to TABLE_ROWS rows (a 2-block MPT's 24); a wider
#: run's (96 layers: 288 rows) scrolled the verdict printed after it off the screen, so there it
#: keeps its TABLE_WORST worst rows and the flagged ones, up to TABLE_ROWS (the markdown has all).
TABLE_ROWS = 30
TABLE_WORST = 10


def terminal_rows(table: Mapping[tuple[str, str], Mapping[str, float]],
                  flagged: Collection[tuple[str, str]]) -> list[tuple[str, str]]:
    """The rows of the worst-value table the terminal shows (TABLE_ROWS), in the table's
    order."""
    order = table_order(table)
    if len(order) <= TABLE_ROWS:
        return order
    kept = set(order[:TABLE_WORST])
    kept.update([key for key in order if key in flagged and key not in kept]
                [:TABLE_ROWS - len(kept)])
    return [key for key in order if key in kept]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_folder", type=Path, nargs="+", metavar="RUN_FOLDER",
                        help="folder holding the run's metrics.jsonl (or the .jsonl file itself), "
                             "a W&B offline run, an MLflow run folder (mlruns/<experiment>/<run "
                             "id>) or mlflow:<run id> (at MLFLOW_TRACKING_URI); several (a sweep): "
                             "each reported in turn into its own folder, then one line each")
    parser.add_argument("--layers", metavar="REGEX",
                        help="layers for the amax/scale time series (searched in layer names, "
                             f"the first {MAX_SERIES_LAYERS} drawn); default: first and last "
                             "block, the layer with the most underflow (mean over steps) and the "
                             "first layer flagged")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="where the PNGs and fp8_report.md go (default: the run folder; "
                             "for an MLflow run, ./fp8_report-<run id>)")
    parser.add_argument("--baseline", type=Path, metavar="RUN", action="append",
                        help="a run to compare the training loss with (the BF16 run, read as "
                             "RUN_FOLDER is): the first step this run's loss departs from it, "
                             "and the layers flagged up to then, and the measured gap; "
                             "default: no comparison")
    parser.add_argument("--max-loss-gap", metavar="PCT",
                        help="with --baseline: the loss departs where it is more than PCT %% "
                             "above the baseline's at --loss-gap-steps compared steps in a row "
                             "(a divergence rule, not a parity test: the gap is printed "
                             f"anyway); default: {100 * MAX_LOSS_GAP:g}")
    parser.add_argument("--loss-gap-steps", metavar="N",
                        help="with --baseline: compared steps in a row above --max-loss-gap "
                             f"that make a departure; default: {LOSS_GAP_STEPS}")


def warn(message: str) -> None:
    print(f"warning: {one_line(message)}", file=sys.stderr)


def _out_folder(out: Path) -> None:
    """Create `--out` (or check the run folder) before drawing, so a bad one is one line."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"{out}: not a folder (--out names the folder for the PNGs and "
                          "fp8_report.md)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ReportError(f"{out}: cannot create the output folder ({e.strerror or e})") from None


#: What a folder the report may not write refuses with: another user's run, a read-only mount.
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def writable_first(run_folder: Path, out: Path | None) -> None:
    """ReportError (one line) where the report may not be written (`NOT_WRITABLE`), said
    before the run is read (minutes for a long one) rather than after. A run that names no run,
    one the user may not read either (another user's private run: `load` says so), and any
    other error (a file where `--out` names a folder: `_out_folder`) are left to their turn."""
    try:
        found = locate(run_folder)
    except ReportError:
        return
    folder = out or found.folder
    try:
        check_writable(folder / "fp8_report.md")
    except OSError as e:
        files = () if isinstance(found.source, MlflowRun) else (
            found.source if isinstance(found.source, tuple) else (found.source,))
        if e.errno not in NOT_WRITABLE or not all(os.access(path, os.R_OK) for path in files):
            return
        elsewhere = "; --out DIR writes the report elsewhere" if out is None else ""
        raise ReportError(f"{folder}: cannot write the report there ({e.strerror or e})"
                          f"{elsewhere}") from None


#: Seconds `--layers` may take over all layer names (each search is cut at MATCH_TIMEOUT_S).
MATCH_BUDGET_S = 2.0


def layers_matching(run: RunMetrics, pattern: str) -> list[str]:
    """The layers `--layers` finds, searched as te_swap's and fp8_stats' regexes are (the `regex`
    engine, each search time-bounded: `filters.search`); ReportError (one line) for a bad regex
    or one that runs out of time, never a hang."""
    try:
        regex.compile(pattern)
    except regex.error as e:
        raise ReportError(f"--layers {pattern!r}: bad regex ({e})") from None
    fix = "simplify it: no nested repetition such as (a*)*"
    started, found = time.monotonic(), []
    for n, layer in enumerate(run.layers, 1):
        try:  # the layer as the keys name it, or as te_swap's and fp8_stats' regexes see it
            if any(search("--layers", pattern, form) for form in full_forms(layer)):
                found.append(layer)
        except OptionError:
            raise ReportError(f"--layers {pattern!r}: takes more than {MATCH_TIMEOUT_S:g} s on "
                              f"layer {elide(layer)!r} (catastrophic backtracking; {fix})"
                              ) from None
        if time.monotonic() - started > MATCH_BUDGET_S:
            raise ReportError(f"--layers {pattern!r}: takes more than {MATCH_BUDGET_S:g} s on "
                              f"{n} of the {len(run.layers)} layer names ({fix})")
    return found


def heatmap_files(stats: list[str]) -> dict[str, str]:
    """stat -> its heatmap's file name: `fp8_heatmap_<stat>.png`, a statistic no file name
    holds (too long, a character such as NUL) made one, each distinct."""
    safe = distinct_labels(stats, lambda stat: re.sub(r"[^\w.+-]", "_", stat), sep="_")
    return {stat: f"fp8_heatmap_{name}.png" for stat, name in safe.items()}


def _png(figure: Any) -> bytes:
    """A drawn figure as PNG bytes, for `write_output` (which never opens the file in place)."""
    import matplotlib

    buffer = io.BytesIO()
    with matplotlib.rc_context({"savefig.format": "png"}):  # a buffer has no suffix to go by
        save_png(figure, buffer)
    return buffer.getvalue()


def replay(run: RunMetrics, tracker: HealthTracker, whatif: bool = False) -> list[Flag]:
    """The run's logging steps through the health rules, in step order; `whatif`: every row is
    a what-if one (`HealthTracker.whatif_recipe` judges it)."""
    for step, table in run.tables():
        tracker.update(step, table, table.keys() if whatif else ())
    return tracker.flags


def first_dump(flags: list[Flag], run: RunMetrics, loaded: Loaded) -> tuple[Flag, Path] | None:
    """The first of the first flagged step's flags whose tensors fp8_stats dumped at that step
    (`dump_steps`), and the dump: what to open to see the values that went wrong."""
    folder = loaded.run_folder or loaded.folder
    places = dump_places(folder, loaded.hparams, loaded.dumps)
    return next(((f, path) for f in first_flags(flags, run)
                 if (path := dump_of(places, f.step, f.layer, f.tensor)) is not None), None)


@dataclass(frozen=True)
class Located:
    """A run given, found before it is read (`locate`): how it was logged and where its report
    goes without --out, so that several runs sharing a folder are refused before any is read."""

    given: Path
    source: MlflowRun | tuple[Path, ...] | Path  # MLflow's run, the .wandb files, metrics.jsonl
    folder: Path  # where its report goes without --out

    def run_id(self) -> object:
        """What two givens naming the same run share (`a` and `a/metrics.jsonl`)."""
        if isinstance(self.source, MlflowRun):
            return self.source.run_id
        if isinstance(self.source, tuple):
            return tuple(path.resolve() for path in self.source)
        return self.source.resolve()


def locate(run_folder: Path) -> Located:
    """The run RUN_FOLDER names (an MLflow run, a W&B offline run, a metrics file) and the folder
    its report goes into; ReportError (one line) where it names none."""
    if (ml := mlflow_run(run_folder)) is not None:
        return Located(run_folder, ml, Path(f"fp8_report-{ml.run_id}"))
    if (files := wandb_files(run_folder)) is not None:
        return Located(run_folder, tuple(files),
                       run_folder if run_folder.is_dir() else run_folder.parent)
    metrics_file = metrics_file_of(run_folder)
    return Located(run_folder, metrics_file, metrics_file.parent)


def shared_folders(runs: list[Path]) -> str | None:
    """Why several runs cannot be reported without --out: two of them write into the same
    folder (the second's report and heatmaps would replace the first's), or the same run is
    given twice. A run that names none is left to its turn (its own error there)."""
    seen: dict[Path, Located] = {}
    for given in runs:
        try:
            found = locate(given)
        except ReportError:
            continue
        if (first := seen.setdefault(found.folder.resolve(), found)) is not found:
            if first.run_id() == found.run_id():
                return f"{first.given} and {given}: the same run given twice; name it once"
            return (f"{first.given} and {given}: both reports would go into {found.folder} (the "
                    "second replacing the first); report them one at a time with --out DIR")
    return None


@dataclass(frozen=True)
class Loaded:
    """A run as read for the report (`load`)."""

    run: RunMetrics
    series: GuardSeries
    hparams: Mapping[str, Any] | None
    hparams_file: Path  # where its hyperparameters were read: named in warnings
    folder: Path  # where its report goes without --out
    hparams_from: str = "hparams.json"  # what the thresholds' line names as their source
    # where fp8_stats' dumps are looked up, where not `folder`: what its record is relative to
    run_folder: Path | None = None
    dumps: tuple[str, ...] = ()  # each attempt's record of its dump folder, latest first (W&B)


def load(run_folder: Path, losses: dict[int, float] | None = None) -> Loaded:
    """The run RUN_FOLDER names, read however it was logged; with `losses`, its training loss
    goes there from the same pass (one read of the file, the same steps as the report's)."""
    found = locate(run_folder)
    if isinstance(ml := found.source, MlflowRun):  # MLflow's own client
        if losses is not None:  # MLflow's client: a query of its own, no file read twice
            losses.update(losses_of(mlflow_history(ml, LOSS)))
        run, series, hparams = load_mlflow(ml, warn)
        in_model_order(run, hparams, ml.where, "MLflow", warn)
        return Loaded(run, series, hparams, ml.where, found.folder, "the MLflow run's params",
                      run_folder_of(ml, hparams))
    if isinstance(files := found.source, tuple):  # a W&B offline run, W&B's reader
        dumps: list[str] = []
        run, series, hparams = load_wandb(run_folder, list(files), warn, losses, dumps)
        in_model_order(run, hparams, files[-1], "W&B's history", warn)
        # W&B's `dir` (`<run folder>/wandb/<attempt>/run-<id>.wandb`): the dumps are beside it
        return Loaded(run, series, hparams, files[-1], found.folder, "the W&B run's config",
                      files[-1].parent.parent.parent, tuple(dumps))
    run, series = load_run(found.source, warn, losses)
    hparams_file = hparams_of(found.source)
    hparams = read_hparams(hparams_file, warn)
    in_model_order(run, hparams, found.source, None, warn)
    return Loaded(run, series, hparams, hparams_file, found.folder)


def make_report(run_folder: Path, layers: str | None = None, out: Path | None = None,
                loss: tuple[str, LossComparison] | None = None, loaded: Loaded | None = None,
                tables: list[WorstTable] | None = None, spiked: LossSpike | None = None
                ) -> tuple[RunMetrics, list[Flag], GuardRun | None, list[Path],
                           tuple[Flag, Path] | None]:
    """Write the PNGs and fp8_report.md; returns the metrics, the flags, what fp8_guard did,
    the written paths (markdown last) and the first flagged step's dump (`first_dump`). `loss`:
    the baseline as named and the loss comparison with it (`compare`), for the headline;
    `loaded`: the run already read (`load`); `tables`: gets the markdown's `worst_table`, for
    the terminal's (made once: each reads every series); `spiked`: the run's loss spikes
    (`health.loss.spike`), for the headline."""
    loaded = loaded or load(run_folder)
    run, series, hparams = loaded.run, loaded.series, loaded.hparams
    hparams_file, folder = loaded.hparams_file, loaded.folder
    matching = None if layers is None else set(layers_matching(run, layers)).__contains__
    thresholds = thresholds_from_hparams(hparams or {}, loaded.hparams_from, warn, hparams_file)
    formats = formats_from_hparams(hparams or {}, run.tensors)
    guard = guard_run(series, hparams, hparams_file, warn, run.later_attempt)
    mark_high_precision(run, guard)
    # the model's blocks (fp8_stats' record of every layer), not only the watched layers'
    # te_swap's recipe for every row where logged (its layers' are not told apart from the
    # rows it left out); without te_swap a row is fp8_stats' what-if (or a TE module the model
    # was built with, whose recipe is not logged)
    swap, whatif = recipes_from_hparams(hparams or {})
    tracker = HealthTracker(thresholds, blocks=model_blocks(layer_order(hparams or {}) or ()),
                            margin=swap.margin if swap else 0,
                            history_len=swap.history_len if swap else None, whatif_recipe=whatif)
    flags = replay(run, tracker, whatif=swap is None)
    worst = worst_table(run)
    if tables is not None:
        tables.append(worst)
    first = next(iter(first_flags(flags, run)), None)
    dump = first_dump(flags, run, loaded)
    chosen = choose_layers(run, matching, (first.layer, first.step) if first else None)
    if not chosen:
        raise ReportError(f"--layers {layers!r} matches none of the "
                          f"{plural(len(run.layers), 'layer')} (e.g. {elide(run.layers[0])!r})")
    given, out = out, out or folder
    _out_folder(out)
    written: list[Path] = []
    target = out
    files = heatmap_files(run.stats)
    try:
        for stat in run.stats:
            if spec(stat).plot == "heatmap" and shown(run, stat):
                target = out / files[stat]
                write_output(target, _png(draw_heatmap(run, stat, thresholds, formats)))
                written.append(target)
        if any(spec(s).plot == "series" for s in run.stats):
            target = out / SERIES_FILE
            write_output(target, _png(draw_series(run, chosen, formats)))
            written.append(target)
        target = out / "fp8_report.md"
        write_output(target, render_report(run, flags, thresholds, chosen[:MAX_SERIES_LAYERS],
                                           [p.name for p in written], guard,
                                           matched=len(chosen), dump=dump, loss=loss,
                                           worst=worst, spike=spiked,
                                           swap=swap_filters(hparams or {}, run.layers)))
    except OSError as e:  # read-only, a full disk, a folder or FIFO in the file's place
        # a run folder someone else's run wrote (a shared store, a read-only mount): say how
        elsewhere = ("; --out DIR writes the report elsewhere"
                     if given is None and e.errno in NOT_WRITABLE
                     else "")
        raise ReportError(f"{target}: cannot write ({e.strerror or e}){elsewhere}") from None
    return run, flags, guard, [*written, target], dump


def gap_options(pct: str, steps: str) -> tuple[float, int]:
    """`--max-loss-gap` (a percentage, > 0) as a fraction and `--loss-gap-steps` (>= 1);
    ReportError (one line) otherwise."""
    try:
        gap = float(pct) / 100
    except ValueError:
        gap = math.nan
    if not (math.isfinite(gap) and gap > 0):
        raise ReportError(f"--max-loss-gap {pct!r}: not a percentage above 0 (e.g. "
                          f"{100 * MAX_LOSS_GAP:g} for {100 * MAX_LOSS_GAP:g} %)")
    if not (steps.strip().isdigit() and int(steps) >= 1):
        raise ReportError(f"--loss-gap-steps {steps!r}: not a whole number of steps from 1 "
                          f"(e.g. {LOSS_GAP_STEPS})")
    return gap, int(steps)


def run(args: argparse.Namespace) -> int:
    """Each run given reported in turn (a sweep: each against the one baseline, read once),
    then one line per run; the worst exit status."""
    runs, baselines = args.run_folder, args.baseline or []
    try:
        if len(baselines) > 1:  # argparse keeps the last: a silent choice among them
            raise ReportError(f"--baseline given {len(baselines)} times ("
                              + ", ".join(map(str, baselines)) + "): one baseline per report "
                              "(the runs to report are the positional RUN_FOLDERs)")
        if len(runs) > 1 and args.out is not None:
            raise ReportError(f"--out with {len(runs)} runs: their reports would overwrite each "
                              "other there; leave --out out (each report goes into its run's "
                              "folder) or report one run per --out")
        if len(runs) > 1 and (shared := shared_folders(runs)) is not None:
            raise ReportError(shared)
        given = [name for name, value in (("--max-loss-gap", args.max_loss_gap),
                                          ("--loss-gap-steps", args.loss_gap_steps))
                 if value is not None]
        if given and not baselines:  # silently unused, a check the user thinks is on
            they, tell = ("they", "tell") if len(given) > 1 else ("it", "tells")
            raise ReportError(f"{' and '.join(given)} without --baseline: {they} {tell} where "
                              "the loss departs from a baseline's; add --baseline RUN (the BF16 "
                              f"run) or leave {'them' if len(given) > 1 else 'it'} out")
        gap, gap_steps = gap_options(
            f"{100 * MAX_LOSS_GAP:g}" if args.max_loss_gap is None else args.max_loss_gap,
            str(LOSS_GAP_STEPS) if args.loss_gap_steps is None else args.loss_gap_steps)
        if len(runs) == 1:  # before the baseline is read too (a sweep's: each in its turn)
            writable_first(runs[0], args.out)
        # the baseline's errors first: it is read in seconds, the runs not
        base = None if not baselines else read_baseline(baselines[0])
    except ReportError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2
    if len(runs) == 1:
        return report_one(args, runs[0], base, gap, gap_steps)[0]
    results = []
    for given in runs:
        print(f"== {one_line(str(given))}")
        sys.stdout.flush()  # before its errors on stderr
        results.append((given, *report_one(args, given, base, gap, gap_steps)))
    print(f"{len(runs)} runs:")
    for given, _, said in results:
        print(f"  {one_line(str(given))}: {said}")
    return max(code for _, code, _ in results)


def _summary(found: int | None, loss: tuple[str, LossComparison] | None,
             spiked: LossSpike | None = None, flagged: int | None = None) -> str:
    """A run's line in the summary of several: flagged layer tensors, the loss spike the loss
    line is about (`LossSpike.main`, by the first FP8 flag at step `flagged`), a rise the log
    ends in (`LossSpike.rising`), the loss against the baseline."""
    said = "no fp8_report.md" if found is None else f"{found} flagged"
    if spiked is not None and (main := spiked.main(flagged)) is not None:
        said += (f", loss spikes at step {main.step}" if main.back is not None else
                 f", loss diverges from step {main.step}")
    if spiked is not None and spiked.rising is not None:
        said += f", loss rising from step {spiked.rising.steps[0]} (open)"
    if loss is not None:
        cmp = loss[1]
        said += (f", loss departs from the baseline at step {cmp.departed}"
                 if cmp.departed is not None else
                 f", no loss step shared with the baseline (this run's loss ends at step "
                 f"{cmp.run_last}, the baseline's at {cmp.base_last})" if not cmp.steps else
                 f", loss gap {100 * cmp.mean_gap:+.3g} % (last {len(cmp.window)} compared steps)")
    return said


def report_one(args: argparse.Namespace, run_folder: Path,
               base: Baseline | None, gap: float, gap_steps: int
               ) -> tuple[int, str]:
    """`report RUN_FOLDER` for one run; its exit status and its line in a summary."""
    loss, notes = None, []
    losses: dict[int, float] = {}
    loaded: Loaded | NoStatistics
    try:
        writable_first(run_folder, args.out)
        try:
            loaded = load(run_folder, losses)
        except NoStatistics as e:  # its loss, read in the same pass, may still be compared
            loaded = e
        if base is not None:
            baseline, base_losses = base.given, base.losses
            if not losses:
                raise ReportError(no_loss(run_folder))
            loss = (str(baseline), compare(losses, base_losses, gap, gap_steps))
            notes += [f"warning: {holes}" for holes in (mlflow_holes(run_folder, losses),
                                                        base.holes) if holes is not None]
            if (same := same_run(run_folder, losses, baseline, base_losses)) is not None:
                notes.append(f"note: {same}; the comparison says nothing")
            elif (other := other_batches(
                    (loaded.hparams or {}) if isinstance(loaded, Loaded) else read_config(run_folder),
                    base)) is not None:
                notes.append(f"warning: {other}")
        if isinstance(loaded, NoStatistics):
            raise loaded
        tables: list[WorstTable] = []
        spiked = spike(losses) if losses else None
        metrics, flags, guard, written, dump = make_report(run_folder, args.layers,
                                                           args.out, loss, loaded, tables, spiked)
    except NoStatistics as e:
        if loss is None:
            print(f"error: {one_line(str(e))}", file=sys.stderr)
            return 2, "error (no FP8 statistics)"
        spiked = spike(losses)  # its spikes and open rise, as a run with statistics says them
        print(spike_line(spiked, []))
        print(departure(loss[1], [], {}, RunMetrics(), loss[0]))
        print("".join(f"{note}\n" for note in notes), end="")
        print(f"note: the loss comparison only, no fp8_report.md: {one_line(str(e))}")
        return 0, _summary(None, loss, spiked)
    except ReportError as e:
        print(f"error: {one_line(str(e))}", file=sys.stderr)
        return 2, "error (above)"
    if not losses:  # read however the run was logged (`load`); else no line says it is missing
        warn(f"{run_folder}: no `{LOSS}` logged (Composer's training loss): the report has no "
             "Loss line, no loss spike looked for")
    found = findings(metrics, flags)
    fallen = fallback_steps(guard)
    swap = swap_filters((loaded.hparams or {}) if isinstance(loaded, Loaded) else {},
                        metrics.layers)
    names = layer_names(metrics, guard)
    kinds = short_names(metrics.tensors)
    fp8 = fp8_layers(metrics.layers, swap)
    advice = guard_advice(guard, swap, fp8)
    held, no_static = advice.held, advice.no_static
    table, cells = tables[0]
    shown_rows = terminal_rows(table, {(f.worst.layer, f.worst.tensor) for f in found})
    print(render_table(table, cells=cells, only=shown_rows), end="")
    if len(shown_rows) < len(table):
        print(f"... {len(table) - len(shown_rows)} of the {len(table)} rows left out here (the "
              f"{TABLE_WORST} worst and the flagged kept, up to {TABLE_ROWS}): all in "
              f"{written[-1]}, 'Worst value per layer and tensor'")
    print()

    def line(group: list[Finding]) -> str:
        f = group[0]
        w = f.worst
        key = change_key(w.yaml_key)
        if (note := not_converted(f, fallen, swap)) is not None:
            change = note[0][0].upper() + note[0][1:] + (key if note[1] else "")
        elif w.layer in fallen:
            change = in_high_precision("it", fallen[w.layer], kept_out(w.layer, swap),
                                       no_static) + (
                f"{TO_FP8}{key}" if runs_in_fp8(w.yaml_key) else "")
        else:
            change = f"Change: {key}"
        limit = (w.limit if len({g.worst.limit for g in group}) == 1 else
                 f"e.g. {max(group, key=lambda g: badness(w.stat, g.worst.value)).worst.limit}")
        return (f"{layers_named(group, metrics.layers, names)} {kinds[w.tensor]}: "
                f"{bounded(w.stat)} {values_said(group)} at {f.worst_at()} ({limit}; "
                f"{f.counted(' steps', each=len(group) > 1)}). Likely cause: {w.cause}. {change}")

    rows = grouped(found, fallen)
    print(f"{len(found)} flagged")
    if found:
        print(f"  {first_flagged(metrics, flags, names, dump=dump)}")
    elif said := nothing_judged(metrics):
        print(f"  {said}")
    if spiked is not None:
        print(f"  {spike_line(spiked, flags, metrics, names)}")
    if loss is not None:
        print(f"  {departure(loss[1], flags, names, metrics, loss[0])}")
        print("".join(f"  {note}\n" for note in notes), end="")
    print("".join(f"  {line(group)}\n" for group in rows[:MAX_PRINTED]), end="")
    if whole := flagged_whole(found, held, fp8, spiked, flags):
        print(f"  {whole}")
    elif together := excluded_together(found, fallen, swap, held):
        print(f"  {EXCLUDE_TOGETHER_HELD if held else EXCLUDE_TOGETHER}{one_line(together)}")
    if len(rows) > MAX_PRINTED:
        print(f"  ... {len(rows) - MAX_PRINTED} more in fp8_report.md")
    if guard is not None and guard.fallbacks:
        after = ("" if no_static else f" Next time: {static_yaml(held, swap.exclude)}"
                 if held else
                 f" {ALREADY_OUT}" if guard.kept else "")
        print(f"{moved(guard)}: " + ", ".join(
            f"{names[layer]} {span}" for layer, span in fallen.items()) + "." + after)
    elif unrecorded := unrecorded_fallbacks(guard):
        print(unrecorded)
    for line in [*refused(guard, names, advice), *([advice.whole] if advice.whole else [])]:
        print(line)
    print(f"plots ({len(written) - 1} PNGs) in {written[0].parent}:")
    for path in written[:-1]:
        print(f"  {path.name}")
    print(f"written to {written[-1]}")
    return 0, _summary(len(found), loss, spiked, min((f.step for f in flags), default=None))
