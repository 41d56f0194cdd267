"""When a layer's FP8 numbers deserve a warning: one set of defaults for `fp8_stats` (which
warns during the run) and `foundry-fp8 report` (which flags afterwards). Plain Python."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    """`max_overflow_pct` is not 0: delayed scaling saturates a few elements by design when a
    tensor's amax grows between steps, and one saturated element in 10,000 is noise, not a
    layer to move to BF16."""

    max_underflow_pct: float = 5.0
    max_overflow_pct: float = 0.01
    min_cos_sim: float = 0.99
    source: str = "fp8_stats defaults"


DEFAULT_THRESHOLDS = Thresholds()
