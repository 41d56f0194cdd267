"""Cost of `fp8_guard` on top of `fp8_stats` at the same interval, tiny CPU MPT, one process.

Each round trains two healthy runs, one with `fp8_stats` alone and one with `fp8_stats` and
`fp8_guard` (defaults), at the same interval, order alternating (stats/guard, then guard/stats).
The guard works inside fp8_stats' logging steps (a listener on the pooled table) and adds no
hooks while every layer is healthy, so its cost is measured two ways:

- in place: every call of the guard (its listener and its event methods) is timed, and so is
  fp8_stats' AFTER_TRAIN_BATCH work (pooling, judging, logging; it calls the listener), in the
  guard run;
- whole steps, as `stats_overhead.py` does: every batch is timed by BATCH_END timestamps, each
  logging step and the step after it are compared with the three steps just before it in the
  same run, and that excess is compared between the two runs; non-logging steps are compared
  between the runs (noise on a shared machine, not a cost: the guard runs nothing there).

Pictures are off in both runs (`image_interval: null`): they cost the same with and without
the guard and would only add noise. Every figure is the median over rounds (min, max), with
the load average of each round.

    .venv/bin/python benchmarks/guard_overhead.py [--rounds 6] [--batches 160] [--interval 10]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from foundry_fp8.cli import missing_dependency_is_one_line  # noqa: E402  (no dependency)

with missing_dependency_is_one_line():
    from benchmarks.stats_overhead import (
        AMORTIZE_OVER,
        check_counts,
        interleave,
        logging_events,
        result_header,
        spread,
        spread_text,
        step_durations,
        write_result,
    )
    from foundry_fp8.tools.tiny_data import prepare_tiny_data
    from tests.tiny_run import run_tiny

HEADLINE = "guard_amortized_pct_interval100"


def _timed(owner: type, name: str, sink: list[tuple[int, float]],
           batch: Callable[[], int]) -> Callable[[], None]:
    """Wrap `owner.name` so each call appends (batch, seconds) to `sink`; returns the undo."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append((batch(), time.perf_counter() - start))

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


def time_run(guard: bool, batches: int, interval: int, data: Any, root: Path) -> dict[str, Any]:
    """One healthy tiny run: per-batch seconds, and (with the guard) the timed calls."""
    from composer.core import Callback

    from foundry_fp8.composer.guard import FP8Guard
    from foundry_fp8.composer.stats import FP8Stats

    class Stamps(Callback):  # appended last: its BATCH_END runs after every other callback's
        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.batch = 0

        def batch_start(self, state, logger) -> None:
            self.batch = int(state.timestamp.batch)

        def batch_end(self, state, logger) -> None:
            self.stamps.append(time.perf_counter())

    stamps = Stamps()
    calls: dict[str, list[tuple[int, float]]] = {"listen": [], "events": [], "stats": []}
    undo = [_timed(FP8Guard, "_listen", calls["listen"], lambda: stamps.batch),
            _timed(FP8Stats, "after_train_batch", calls["stats"], lambda: stamps.batch)]
    undo += [_timed(FP8Guard, name, calls["events"], lambda: stamps.batch)
             for name in ("batch_end", "batch_checkpoint")]
    train_module = importlib.import_module("llmfoundry.command_utils.train")
    trainer_class = train_module.Trainer

    def with_stamps(*args: Any, **kwargs: Any) -> Any:
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), stamps]
        return trainer_class(*args, **kwargs)

    callbacks: dict[str, Any] = {"fp8_stats": {"interval": f"{interval}ba",
                                               "image_interval": None}}
    if guard:
        callbacks["fp8_guard"] = {}
    train_module.Trainer = with_stamps
    try:
        trainer = run_tiny(root, data, {
            "max_duration": f"{batches}ba", "eval_interval": f"{batches}ba",
            "save_interval": f"{batches}ba", "console_log_interval": f"{batches}ba",
            "callbacks": callbacks})
    finally:
        train_module.Trainer = trainer_class
        for restore in undo:
            restore()
    if guard:
        found = next(c for c in trainer.state.callbacks if isinstance(c, FP8Guard))
        assert found.core is not None and not found.disabled, "fp8_guard did not run"
        assert not found.core.fallbacks, f"a healthy run fell back: {list(found.core.fallbacks)}"
    return {"durations": step_durations(stamps.stamps), **calls}


def round_figures(stats: dict[str, Any], guarded: dict[str, Any], interval: int,
                  warmup: int) -> dict[str, float]:
    """One round's numbers from the fp8_stats-only run and the run with the guard."""
    batches = len(guarded["durations"]) + 1
    logging = [b for b in range(warmup, batches) if b % interval == 0]
    other = [b for b in range(warmup, batches) if b % interval]
    def by_batch(calls: list[tuple[int, float]]) -> dict[int, float]:
        summed: dict[int, float] = {}
        for batch, seconds in calls:
            summed[batch] = summed.get(batch, 0.0) + seconds
        return summed

    listen, per_batch = by_batch(guarded["listen"]), by_batch(guarded["listen"]
                                                             + guarded["events"])
    # fp8_stats' own work: its AFTER_TRAIN_BATCH less the guard's listener it calls
    stats_work = {b: s - listen.get(b, 0.0) for b, s in by_batch(guarded["stats"]).items()}
    guard = statistics.median(per_batch[b] for b in logging)

    def excess_ms(durations: list[float]) -> float:
        """Median extra time of a logging step and the step after it over the steps before."""
        return 1000 * statistics.median(log + after - 2 * base for base, log, after
                                        in logging_events(durations, interval, warmup))

    def other_ms(durations: list[float]) -> float:
        return 1000 * statistics.median(d for i, d in enumerate(durations)
                                        if i + 1 >= warmup and (i + 1) % interval not in (0, 1))

    train_step = other_ms(stats["durations"])
    return {
        "stats_other_ms": train_step, "guard_other_ms": other_ms(guarded["durations"]),
        "non_logging_step_slowdown_pct": 100 * (other_ms(guarded["durations"]) / train_step - 1),
        "stats_logging_excess_ms": excess_ms(stats["durations"]),
        "guard_run_logging_excess_ms": excess_ms(guarded["durations"]),
        "logging_excess_difference_ms": (excess_ms(guarded["durations"])
                                         - excess_ms(stats["durations"])),
        "guard_ms_per_logging_step": 1000 * guard,
        "guard_us_per_other_step": 1e6 * statistics.median(per_batch.get(b, 0.0) for b in other),
        "stats_work_ms_per_logging_step": 1000 * statistics.median(stats_work[b]
                                                                   for b in logging),
        "guard_vs_stats_logging_pct": 100 * statistics.median(per_batch[b] / stats_work[b]
                                                              for b in logging),
        HEADLINE: 100 * guard / (AMORTIZE_OVER * train_step / 1000),
        "logging_steps": len(logging),
    }


KEYS = ("stats_other_ms", "non_logging_step_slowdown_pct", "stats_logging_excess_ms",
        "guard_run_logging_excess_ms", "logging_excess_difference_ms",
        "guard_ms_per_logging_step", "guard_us_per_other_step",
        "stats_work_ms_per_logging_step", "guard_vs_stats_logging_pct", HEADLINE)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batches", type=int, default=160)
    parser.add_argument("--interval", type=int, default=10, help="fp8_stats interval (both runs)")
    parser.add_argument("--warmup", type=int, default=10, help="batches dropped at the start of each run")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    check_counts(parser, args)
    data = prepare_tiny_data(REPO / "data")
    load_before = os.getloadavg()
    started = datetime.now(timezone.utc)
    rounds = interleave(
        args.rounds, ("stats", "guard"),
        lambda variant, root: time_run(variant == "guard", args.batches, args.interval, data,
                                       root),
        lambda runs: round_figures(runs["stats"], runs["guard"], args.interval, args.warmup))
    result = {
        **result_header(started, load_before),
        "config": {"rounds": args.rounds, "batches": args.batches, "interval": args.interval,
                   "warmup": args.warmup},
        "results": {k: spread([r[k] for r in rounds]) for k in KEYS},
        "rounds": rounds,
    }
    write_result(args.out, "guard_overhead_cpu", result, render_markdown(result))
    return 0


def render_markdown(result: dict[str, Any]) -> str:
    r, cfg = result["results"], result["config"]

    def fmt(key: str, unit: str = "", digits: int = 2) -> str:
        return spread_text(r[key], unit, digits)

    rows = "\n".join(
        f"| {i} | {x['order']} | {x['stats_other_ms']:.1f} | {x['guard_other_ms']:.1f} | "
        f"{x['stats_logging_excess_ms']:.1f} | {x['guard_run_logging_excess_ms']:.1f} | "
        f"{x['guard_ms_per_logging_step']:.3f} | {x['stats_work_ms_per_logging_step']:.1f} | "
        f"{x[HEADLINE]:.4f} | {x['logging_steps']} | "
        f"{x['load_1min_start']:.2f} / {x['load_1min_end']:.2f} |"
        for i, x in enumerate(result["rounds"]))
    load = result["load_average"]
    return f"""# fp8_guard overhead on top of fp8_stats, tiny MPT on CPU ({result["date"]})

Machine: {result["machine"]["cpu"]}, {result["machine"]["cores"]} cores shared with other jobs.
Load average (1/5/15 min): {"/".join(f"{v:.2f}" for v in load["before"])} before,
{"/".join(f"{v:.2f}" for v in load["after"])} after ({result["duration_s"]} s); per round below. The
benchmark itself keeps about 2 threads busy, so a load near 2 means little else ran; above
it, other jobs competed for the 2 cores.
Versions: {", ".join(f"{k} {v}" for k, v in result["versions"].items())}.

Method: {cfg["rounds"]} rounds, each one healthy run with `fp8_stats` alone and one with
`fp8_stats` and `fp8_guard` (defaults), both at interval {cfg["interval"]} without pictures
(order alternating), {cfg["batches"]} batches per run, the first {cfg["warmup"]} dropped. No layer
fell back (checked), so the guard added no hooks. In the guard run every call of the guard and
fp8_stats' AFTER_TRAIN_BATCH work (which calls the guard's listener) are timed in place. Every
batch of both runs is timed by Composer BATCH_END timestamps; each logging step and the step
after it are compared with the median of the three steps just before it in the same run (its
excess), so load changes on the shared machine cancel out. Figures: median over rounds (min,
max).

| result | value |
|---|---|
| training step (fp8_stats run, non-logging steps) | {fmt("stats_other_ms", " ms", 1)} |
| fp8_stats' AFTER_TRAIN_BATCH work at a logging step (pooling, judging, logging; timed in place, the guard's listener left out) | {fmt("stats_work_ms_per_logging_step", " ms")} |
| **fp8_guard at a logging step (timed in place)** | {fmt("guard_ms_per_logging_step", " ms", 3)} |
| fp8_guard at another step (timed in place) | {fmt("guard_us_per_other_step", " us", 1)} |
| fp8_guard / that work of fp8_stats | {fmt("guard_vs_stats_logging_pct", " %")} |
| **fp8_guard amortized at interval {AMORTIZE_OVER}** (its logging-step time over {AMORTIZE_OVER} training steps) | {fmt(HEADLINE, " %", 4)} |
| logging-step excess, fp8_stats alone (whole steps) | {fmt("stats_logging_excess_ms", " ms", 1)} |
| logging-step excess, fp8_stats + fp8_guard (whole steps) | {fmt("guard_run_logging_excess_ms", " ms", 1)} |
| difference of the two excesses | {fmt("logging_excess_difference_ms", " ms", 1)} |
| non-logging step with the guard vs without (interleaved runs) | {fmt("non_logging_step_slowdown_pct", " %")} |

The in-place timing is the guard's cost. fp8_stats' in-place figure is only its work after the
batch: its hooks compute the statistics inside the logging step's forward and backward, which
the whole-step excess includes. The two excesses check the guard's cost from outside: their
difference should be the guard's logging-step time within the noise their spread shows.
Non-logging steps run nothing of the guard but two event methods that return at once; their
difference between the runs is run-to-run noise on the shared machine, not a cost.

| round | order | fp8_stats run: ms/step | guard run: ms/step | logging excess, stats (ms) | logging excess, stats + guard (ms) | guard at a logging step (ms) | fp8_stats after the batch (ms) | guard amortized % @{AMORTIZE_OVER} | logging steps | load 1 min (start / end) |
|---|---|---|---|---|---|---|---|---|---|---|
{rows}
"""


if __name__ == "__main__":
    with missing_dependency_is_one_line():
        raise SystemExit(main())
