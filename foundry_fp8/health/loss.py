"""Where a run's training loss departs from a baseline run's (`foundry-fp8 report --baseline`):
an FP8 run against the BF16 run it should track. Compared at the steps both logged only: at a
step both runs trained on the same batch, so their losses differ by the numerics alone, while a
loss interpolated between another run's steps would mix batches. The departure rule catches a
divergence; the measured gap (`LossComparison.mean_gap`) is what says how close the runs are.
Without a baseline, the run's own loss spikes (`spike`). Plain Python."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from foundry_fp8.health.thresholds import (
    LOSS_GAP_STEPS,
    LOSS_SPIKE_JUMP,
    LOSS_SPIKE_MIN,
    LOSS_SPIKE_OPEN,
    LOSS_SPIKE_RATIO,
    LOSS_SPIKE_STEPS,
    LOSS_SPIKE_WINDOW,
    MAX_LOSS_GAP,
)

#: The share of the compared steps, the last ones, that the mean gap is taken over.
GAP_WINDOW = 0.1


def gap(loss: float, base: float) -> float:
    """The run's loss relative to the baseline's (+0.04: 4 % above); NaN where either is
    NaN/Inf or the baseline's is 0."""
    if not (math.isfinite(loss) and math.isfinite(base)) or base == 0:
        return math.nan
    return (loss - base) / abs(base)


@dataclass(frozen=True)
class LossComparison:
    """The run's loss against the baseline's, at the steps both logged with a finite baseline."""

    steps: list[int]  # compared, in order
    departed: int | None  # the first step of the departure, None where it stays within
    loss: float | None  # the run's and the baseline's loss at `departed`
    base: float | None
    run_last: int  # the run's last logged loss step
    base_last: int  # the baseline's last finite loss step
    base_nan_from: int | None  # where the baseline's loss is NaN/Inf from (to its end)
    back: int | None  # after a departure: the compared step from which it stays within
    window: list[int]  # the last GAP_WINDOW of the compared steps, at least one
    mean_gap: float  # mean `gap` over `window`: NaN where one is (a NaN/Inf loss there)
    last_gap: float  # `gap` at the last compared step
    max_gap: float  # the rule: more than this `gap` ...
    gap_steps: int  # ... at this many compared steps in a row


def compare(losses: Mapping[int, float], baseline: Mapping[int, float],
            max_gap: float = MAX_LOSS_GAP, gap_steps: int = LOSS_GAP_STEPS) -> LossComparison:
    """The first step from which the run's loss stays more than `max_gap` above the baseline's
    at `gap_steps` compared steps in a row, or is NaN/Inf (at once); scanning on, the step from
    which it is back within for good. `losses` and `baseline`: step -> loss, neither empty, the
    baseline with a finite loss; a NaN/Inf baseline step is not compared."""
    steps = sorted(s for s in losses.keys() & baseline.keys() if math.isfinite(baseline[s]))

    def above(step: int) -> bool:
        loss, base = losses[step], baseline[step]
        return not math.isfinite(loss) or loss - base > max_gap * abs(base)

    run_since: int | None = None
    streak = 0
    departed = None
    for step in steps:
        if not above(step):
            run_since, streak = None, 0
            continue
        run_since = step if run_since is None else run_since
        streak += 1
        if streak >= gap_steps or not math.isfinite(losses[step]):
            departed = run_since
            break
    back = None
    if departed is not None:
        later = [s for s in steps if s > departed]
        last_above = max((s for s in later if above(s)), default=departed)
        back = next((s for s in later if s > last_above), None)
    finite = [s for s, v in baseline.items() if math.isfinite(v)]
    base_last = max(finite)
    nan_after = [s for s in baseline if s > base_last]
    window = steps[-max(1, math.ceil(GAP_WINDOW * len(steps))):] if steps else []
    # every step of the window (a NaN gap makes the mean NaN): one left out would make it a mean
    # over fewer steps than `measured_gap` says
    gaps = [gap(losses[s], baseline[s]) for s in window]
    return LossComparison(steps, departed,
                          None if departed is None else losses[departed],
                          None if departed is None else baseline[departed],
                          max(losses), base_last, min(nan_after, default=None), back, window,
                          math.fsum(gaps) / len(gaps) if gaps else math.nan,
                          gap(losses[steps[-1]], baseline[steps[-1]]) if steps else math.nan,
                          max_gap, gap_steps)


@dataclass(frozen=True)
class Spike:
    """One loss spike: where it starts and where the loss is back (`spike`)."""

    step: int  # its first step
    loss: float  # the loss there
    median: float | None  # the median it is more than `ratio` times; None for NaN/Inf at once
    over: int  # how many losses that median is of
    back: int | None  # the first step with the loss back within; None: not by the last logged


@dataclass(frozen=True)
class Rise:
    """A rise above the ratio that the log ends in, too short for a spike yet: a run read while
    it trains may be diverging right now (`spike`)."""

    steps: tuple[int, ...]  # the logged steps above the ratio, in a row, up to the log's end
    low: float  # the least and the greatest of their losses over `median`
    high: float
    median: float  # the median of the losses before the rise ...
    over: int  # ... of this many


@dataclass(frozen=True)
class LossSpike:
    """The run's loss spikes (`spike`), in step order, over the steps looked at."""

    spikes: tuple[Spike, ...]
    first: int  # the logged loss steps looked at, from `first` to `last`
    last: int
    ratio: float  # the rule: more than `ratio` times the median ...
    steps: int  # ... at this many logged steps in a row, ...
    jump: float  # ... or more than `jump` times it at once ...
    window: int  # ... of up to `window` finite losses logged before
    rising: Rise | None = None  # the log ends in a rise not yet a spike, `open` steps or more

    @property
    def diverged(self) -> Spike | None:
        """The spike the loss never came back from, by the last logged step."""
        return next((s for s in self.spikes if s.back is None), None)

    def main(self, flagged: int | None) -> Spike | None:
        """The spike a post-mortem reads first: where the loss diverged; else the first at or
        after the first FP8 flag (step `flagged`), which may be its doing; else the first."""
        later = [s for s in self.spikes if flagged is not None and s.step >= flagged]
        return self.diverged or next(iter(later or self.spikes), None)


def _median(ordered: list[float]) -> float:
    middle = len(ordered) // 2
    return (ordered[middle] if len(ordered) % 2 else
            (ordered[middle - 1] + ordered[middle]) / 2)


def spike(losses: Mapping[int, float], ratio: float = LOSS_SPIKE_RATIO,
          steps: int = LOSS_SPIKE_STEPS, jump: float = LOSS_SPIKE_JUMP,
          window: int = LOSS_SPIKE_WINDOW, least: int = LOSS_SPIKE_MIN,
          open_steps: int = LOSS_SPIKE_OPEN) -> LossSpike:
    """The loss spikes: each starts at a NaN/Inf loss, at a loss more than `jump` times the
    median of the up to `window` finite losses logged before it (`least` of them at least; a
    median at or below 0, of a loss that is no cross-entropy, says nothing), or at the first of
    `steps` logged losses in a row more than `ratio` times that median (a noisy step alone is
    no spike); it lasts until a finite loss is within `ratio` times that median again. A
    spike's losses stay out of the later medians. Where the log ends in `open_steps` or more
    such losses in a row, too few for a spike, that rise is `rising`. `losses`: step -> loss,
    not empty."""
    before: list[float] = []  # the last `window` finite losses outside spikes, sorted
    recent: list[float] = []  # the same, in step order
    streak: list[int] = []  # the steps in a row above `ratio` times `ref`, not yet a spike
    ref: float | None = None  # the median before the streak or the spike
    found: list[Spike] = []
    order = sorted(losses)

    def keep(loss: float) -> None:
        bisect.insort(before, loss)
        recent.append(loss)
        if len(recent) > window:
            del before[bisect.bisect_left(before, recent.pop(0))]

    def start(step: int, median: float | None) -> None:
        found.append(Spike(step, losses[step], median, len(before), None))

    for step in order:
        loss = losses[step]
        if found and found[-1].back is None:  # in a spike: is the loss back?
            if math.isfinite(loss) and (ref is None or loss <= ratio * ref):
                found[-1] = replace(found[-1], back=step)
                keep(loss)
            continue
        median = _median(before) if len(before) >= least else None
        median = median if median is not None and median > 0 else None
        if not math.isfinite(loss):
            ref = ref if streak else median
            start(streak[0] if streak else step, None if not streak else ref)
            streak = []
            continue
        base = ref if streak else median
        if base is not None and loss > ratio * base:
            ref = base
            streak.append(step)
            if len(streak) >= steps or loss > jump * base:
                start(streak[0], ref)
                streak = []
            continue
        for held in streak:  # noise after all
            keep(losses[held])
        streak = []
        keep(loss)
    rising = None
    if ref is not None and len(streak) >= open_steps:
        over = [losses[s] / ref for s in streak]
        rising = Rise(tuple(streak), min(over), max(over), ref, len(before))
    return LossSpike(tuple(found), order[0], order[-1], ratio, steps, jump, window, rising)
