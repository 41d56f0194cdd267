"""Count phrases through the one `plural` (s29 advice2): fp8_guard's tracker (persist_steps 1)
flagged gradient underflow 'rising 1 logging steps in a row' in its fit-end table and warnings
(the lr=1000 docs try); fp8_state said 'fp8_guard held 1 layers'; `report --layers` said
'matches none of the 1 layers'."""

from __future__ import annotations

from foundry_fp8.health import HealthTracker, Thresholds, plural
from tests.test_health import LAYERS, table


def test_plural():
    assert (plural(1, "layer"), plural(0, "layer"), plural(3, "logging step")) == (
        "1 layer", "0 layers", "3 logging steps")


def test_rising_underflow_at_one_logging_step_reads_singular():
    """fp8_guard's own tracker judges with persist_steps 1 (`guard.thresholds`)."""
    tracker = HealthTracker(Thresholds(persist_steps=1))
    flags = [tracker.update(step, table(b1_gradient={"underflow_pct": v}))
             for step, v in ((10, 0.5), (20, 2.5))]
    [flag] = flags[1][(LAYERS[1], "gradient")]
    assert flag.rule == "underflow_rising"
    assert flag.limit == "rising 1 logging step in a row, to > 1 %", flag.limit
