"""What each FP8 statistic means: which side is worse, its label, how it is drawn. The one
place that says which direction of a statistic is bad. Plain Python."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Worse = Literal["high", "low", "far_from_1"]


@dataclass(frozen=True)
class StatSpec:
    """How one statistic is ranked, drawn and explained."""

    label: str  # colour-bar / axis label, with units
    worse: Worse | None  # None: not ranked (e.g. scale)
    plot: Literal["heatmap", "series"] | None
    log: bool = False  # log colour / y scale
    shared_scale: bool = True  # one colour scale for all tensor kinds (comparable numbers)
    listed: bool = True  # worth a "worst layers" entry (amax is not comparable across layers)
    quiet_when_zero: bool = False  # drawn and tabled only when some value is non-zero


SPECS: dict[str, StatSpec] = {
    "underflow_pct": StatSpec("% of finite nonzero elements flushed to 0", "high", "heatmap"),
    "overflow_pct": StatSpec("% of elements above the FP8 max", "high", "heatmap"),
    "rel_mse": StatSpec("relative MSE = ‖x - fp8(x)‖² / ‖x‖² (log)", "high", "heatmap", log=True),
    "mse": StatSpec("MSE of the FP8 round trip (tensor units², log)", "high", None, log=True,
                    shared_scale=False, listed=False),
    "cos_sim": StatSpec("cosine similarity with the FP8 round trip", "low", "heatmap"),
    "nan_count": StatSpec("NaN elements", "high", "heatmap", quiet_when_zero=True),
    "inf_count": StatSpec("Inf elements", "high", "heatmap", quiet_when_zero=True),
    "amax": StatSpec("amax = max |x|", "high", "series", log=True, listed=False),
    "amin": StatSpec("smallest non-zero |x|", None, None, log=True),
    "scale": StatSpec("scale (x is multiplied by it before the cast)", None, "series", log=True),
    "current_scale": StatSpec("current_scale = FP8 max / amax", None, "series", log=True),
    "scale_ratio": StatSpec("scale_ratio = scale in force / current scale "
                            "(> 1: overflow side, < 1: underflow side)", "far_from_1", "series",
                            log=True),
}
#: The value of a statistic that cannot be better (a "worst layers" list leaves such layers out).
PERFECT = {"high": 0.0, "low": 1.0, "far_from_1": 1.0}


def spec(stat: str) -> StatSpec:
    """A statistic this version does not know still gets a heatmap, larger taken as worse."""
    known = SPECS.get(stat)
    return known if known is not None else StatSpec(stat, "high", "heatmap")


def badness(stat: str, value: float) -> float:
    """A number that grows as `value` gets worse, so one `max` ranks every statistic."""
    worse = spec(stat).worse
    if worse == "low":
        return -value
    if worse == "far_from_1":
        return abs(math.log(value)) if value > 0 else math.inf
    return value


def worse_of(stat: str, a: float, b: float) -> float:
    """The worse of two values of `stat` (NaN never wins: NaN/Inf counts report those)."""
    if a != a:
        return b
    if b != b:
        return a
    return b if badness(stat, b) > badness(stat, a) else a


def known_first(names: Iterable[str], known: Iterable[str]) -> list[str]:
    """`names` in the order of `known`, unknown ones after them in their own order."""
    order = {name: i for i, name in enumerate(known)}
    return sorted(names, key=lambda name: order.get(name, len(order)))
