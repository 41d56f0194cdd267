"""When a layer's FP8 numbers deserve a warning: one set of defaults for `fp8_stats` (which
warns during the run), the guard, and `foundry-fp8 report` (which flags afterwards).

The defaults separate a healthy delayed-scaling run from real trouble (docs/report.md gives the
numbers they come from): a weight that grows slowly saturates a few elements for one logging
step with its scale ratio near 1, so overflow and underflow are judged over `persist_steps`
consecutive logging steps, and only a jump of the amax (`spike_ratio`) is flagged at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    """Limits of the flagging rules (`health.rules`)."""

    max_underflow_pct: float = 5.0
    max_overflow_pct: float = 0.01
    min_cos_sim: float = 0.99
    persist_steps: int = 3  # consecutive logging steps over a limit before a flag
    spike_ratio: float = 2.0  # overflow with scale_ratio at least this: an amax spike, flagged at once
    stale_ratio: float = 1 / 16  # underflow with scale_ratio below this: an old spike in the history
    source: str = "fp8_stats defaults"

    def __post_init__(self) -> None:
        checks = {
            "max_underflow_pct": 0 <= self.max_underflow_pct <= 100,
            "max_overflow_pct": 0 <= self.max_overflow_pct <= 100,
            "min_cos_sim": -1 <= self.min_cos_sim <= 1,
            "persist_steps": isinstance(self.persist_steps, int) and self.persist_steps >= 1,
            "spike_ratio": self.spike_ratio > 1,
            "stale_ratio": 0 < self.stale_ratio < 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: {getattr(self, name)!r} is out of range")


DEFAULT_THRESHOLDS = Thresholds()
