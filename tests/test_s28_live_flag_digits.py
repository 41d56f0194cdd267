"""fp8_stats' and fp8_guard's live warnings print a flagged value as the report does: a value
that would print as its limit gets the digits that tell them apart. The warning read
"cos_sim 0.9984 (< 0.9984)" for 0.99836 against `min_cos_sim: 0.9984` (the report fixed it in
session 28; the live `Flag.reading` kept `.4g`)."""

from __future__ import annotations

import re

import pytest

from foundry_fp8.health.rules import HealthTracker
from foundry_fp8.health.thresholds import Thresholds

KEY = ("blocks.0.attn.Wqkv", "activation")
FINE = {"underflow_pct": 0.0, "overflow_pct": 0.0, "cos_sim": 0.9999, "scale_ratio": 1.0}


@pytest.mark.parametrize(("stats", "stat", "limit"), [
    ({"cos_sim": 0.99836}, "cos_sim", 0.9984),
    ({"underflow_pct": 5.004}, "underflow_pct", 5.0),
])
def test_a_flagged_value_never_reads_as_its_limit(stats, stat, limit):
    tracker = HealthTracker(Thresholds(min_cos_sim=0.9984))
    [flag] = tracker.update(3, {KEY: {**FINE, **stats}})[KEY]
    said = re.search(rf"{stat} (\S+)(?: %)? \(([<>]) ", flag.message)
    assert said, flag.message
    shown = float(said[1])
    # the printed number sits on the flagged side of the limit, and is not the limit
    assert shown != limit and (shown < limit) == (said[2] == "<"), flag.message
    assert shown == pytest.approx(stats[stat], rel=1e-4)


def test_a_value_far_from_its_limit_keeps_its_short_form():
    tracker = HealthTracker()
    [flag] = tracker.update(3, {KEY: {**FINE, "underflow_pct": 21.94}})[KEY]
    assert "underflow_pct 21.9 % (> 5 %" in flag.message, flag.message
