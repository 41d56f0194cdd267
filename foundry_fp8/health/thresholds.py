"""When a layer's FP8 numbers deserve a warning: one set of defaults for `fp8_stats` (which
warns during the run), the guard, and `foundry-fp8 report` (which flags afterwards).

The defaults separate a healthy delayed-scaling run from real trouble (docs/report.md gives the
numbers they come from): a weight that grows slowly saturates its largest element or two at
every logging step with its scale ratio within 1 % of 1, which clips them less than FP8
rounding moves them (`clip_ratio`). Overflow is judged over `persist_steps` consecutive
logging steps, unless the amax jumped (`spike_ratio`); underflow, cosine and NaN/Inf at once
(a healthy run stays far from their limits after its first cast).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Thresholds:
    """Limits of the flagging rules (`health.rules`)."""

    max_underflow_pct: float = 5.0
    max_overflow_pct: float = 0.01
    min_cos_sim: float = 0.99
    persist_steps: int = 3  # consecutive logging steps of clipping overflow before a flag
    # Overflow counts only with scale_ratio above this: below it, saturation clips the largest
    # elements by less than E4M3 rounds them anyway (half a step at the max: 16/448 = 1/28).
    clip_ratio: float = 1 + 1 / 28
    spike_ratio: float = 2.0  # overflow with scale_ratio at least this: an amax spike, flagged at once
    stale_ratio: float = 1 / 16  # underflow with scale / current_scale below this: an old spike in the history
    source: str = "fp8_stats defaults"

    def __post_init__(self) -> None:
        for name, (ok, _) in RANGES.items():
            if not ok(getattr(self, name)):
                raise ValueError(f"{name}: {getattr(self, name)!r} is out of range")


#: Each limit's valid values, and them in words: the report refuses a run's value outside them
#: by name, keeping its other limits.
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "max_underflow_pct": (lambda v: 0 <= v <= 100, "0 to 100"),
    "max_overflow_pct": (lambda v: 0 <= v <= 100, "0 to 100"),
    "min_cos_sim": (lambda v: -1 <= v <= 1, "-1 to 1"),
    "persist_steps": (lambda v: isinstance(v, int) and v >= 1, "an integer of at least 1"),
    "clip_ratio": (lambda v: v >= 1, "at least 1"),
    "spike_ratio": (lambda v: v > 1, "above 1"),
    "stale_ratio": (lambda v: 0 < v < 1, "between 0 and 1"),
}


DEFAULT_THRESHOLDS = Thresholds()

#: `foundry-fp8 report --baseline`: the run's training loss departs from the baseline's where it
#: is more than this fraction above it (relative to the baseline's loss, so it holds for any
#: loss scale) at LOSS_GAP_STEPS compared steps in a row, or is NaN/Inf where the baseline's is
#: finite. Both runs see the same batch at a step (same seed and data order), so a gap is the
#: numerics', not the data's; FP8 runs that train well stay within about 1 % of BF16.
MAX_LOSS_GAP = 0.05
LOSS_GAP_STEPS = 3

#: `foundry-fp8 report`: the training loss spikes where it is more than LOSS_SPIKE_RATIO times the
#: median of the LOSS_SPIKE_WINDOW finite losses logged before it (at least LOSS_SPIKE_MIN of
#: them) at LOSS_SPIKE_STEPS logged steps in a row, or more than LOSS_SPIKE_JUMP times it at once,
#: or is NaN/Inf; the spike lasts until the loss is within the ratio again. A median of the steps
#: just before follows a decreasing loss down and ignores a noisy step among them; LLM
#: pretraining's batch-to-batch noise is a few percent, while a divergence doubles the loss or
#: worse (toward ln(vocab size) or NaN) and stays there. Small-batch fine-tuning is noisier: with
#: log-normal noise of sigma 0.3 one step in 100 is above 2x the median: one step alone made a
#: spike in each of 200 runs of 3000 steps, 3 in a row over a median of 20 in 4 of them, 5 in a
#: row over a median of 50 in none (nor at sigma 0.35; 1 at 0.4); no such noise reaches 10x in
#: one step (sigma 0.3: 7.7 sigma). No baseline needed: the line a
#: post-mortem reads first, next to the first FP8 flag.
LOSS_SPIKE_RATIO = 2.0
LOSS_SPIKE_STEPS = 5
LOSS_SPIKE_JUMP = 10.0
LOSS_SPIKE_WINDOW = 50
LOSS_SPIKE_MIN = 5
#: A rise above LOSS_SPIKE_RATIO times that median at the last LOSS_SPIKE_OPEN logged steps or
#: more (under LOSS_SPIKE_STEPS, under LOSS_SPIKE_JUMP) is no spike yet, but where the log ends
#: there (the report run on a live run) a divergence may be starting: the report says so, marked
#: open. One step is not enough: sigma 0.3 fine-tuning noise ends a log above 2x at about one
#: report in 100; two in a row at about one in 10^4.
LOSS_SPIKE_OPEN = 2
