"""Where a run's training loss departs from a baseline run's (`foundry-fp8 report --baseline`):
an FP8 run against the BF16 run it should track. Compared at the steps both logged only: at a
step both runs trained on the same batch, so their losses differ by the numerics alone, while a
loss interpolated between another run's steps would mix batches. Plain Python."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from foundry_fp8.health.thresholds import LOSS_GAP_STEPS, MAX_LOSS_GAP


def above(loss: float, base: float) -> bool:
    """Whether the run's `loss` departs from the baseline's `base` at one step (`base` finite):
    more than MAX_LOSS_GAP of |base| above it, or NaN/Inf."""
    return not math.isfinite(loss) or loss - base > MAX_LOSS_GAP * abs(base)


@dataclass(frozen=True)
class LossComparison:
    """The run's loss against the baseline's, at the steps both logged with a finite baseline."""

    steps: list[int]  # compared, in order
    departed: int | None  # the first step of the departure, None where it stays within
    loss: float | None  # the run's and the baseline's loss at `departed`
    base: float | None
    run_last: int  # each run's last logged loss step
    base_last: int


def compare(losses: Mapping[int, float], baseline: Mapping[int, float]) -> LossComparison:
    """The first step from which the run's loss stays above the baseline's (`above`) at
    LOSS_GAP_STEPS compared steps in a row, or is NaN/Inf (at once). `losses` and `baseline`:
    step -> loss, neither empty; a NaN/Inf baseline step is not compared."""
    steps = sorted(s for s in losses.keys() & baseline.keys() if math.isfinite(baseline[s]))
    run_since: int | None = None
    streak = 0
    departed = None
    for step in steps:
        if not above(losses[step], baseline[step]):
            run_since, streak = None, 0
            continue
        run_since = step if run_since is None else run_since
        streak += 1
        if streak >= LOSS_GAP_STEPS or not math.isfinite(losses[step]):
            departed = run_since
            break
    return LossComparison(steps, departed,
                          None if departed is None else losses[departed],
                          None if departed is None else baseline[departed],
                          max(losses), max(baseline))
