"""A long run costs the same memory at its last logging step as at its first: the health
trackers of fp8_stats and fp8_guard kept a log of every flag raised (`HealthTracker.flags`),
which grew by every bad row of every logging step for the whole run (at `interval: 1` on a
tiny model, about 1.2 kB per batch; an MPT-1B has 288 rows)."""

from __future__ import annotations

import torch
from torch import nn

from foundry_fp8.guard import GuardConfig, GuardCore
from foundry_fp8.health import layer_key
from foundry_fp8.monitor import FP8Monitor, MonitorConfig, Schedule

STEPS = 50


def test_fp8_stats_keeps_only_the_last_logging_steps_flags():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    with torch.no_grad():  # one huge weight: its cast crushes the rest to 0 at every step
        model[1].weight[0, 0] = 1e6
    monitor = FP8Monitor(model, MonitorConfig(), on_warning=lambda _: None,
                         schedule=Schedule(interval=1))
    raised = 0
    for step in range(STEPS):
        monitor.start_step(step)
        model(torch.randn(8, 32)).sum().backward()
        metrics = monitor.finish_step()
        raised += sum(len(found) for found in monitor.flags.values())
    # the layer is bad at every step (an independent check: its weight's own underflow)
    assert metrics[layer_key("underflow_pct", "weight", "1")] > 90
    assert raised >= STEPS - 1
    assert ("1", "weight") in monitor.flags  # this step's flags are still there for listeners
    assert monitor.tracker.flags == []  # was every flag of the 50 steps


def test_fp8_guard_keeps_no_log_of_flags():
    core = GuardCore(GuardConfig(consecutive=1, repromote_after=1000, max_fallback_share=1.0),
                     {"a": 0.5, "b": 0.5})
    bad = {"activation": {"underflow_pct": 90.0, "overflow_pct": 0.0, "cos_sim": 1.0}}
    for step in range(STEPS):
        table = {("a", "activation"): bad["activation"], ("b", "activation"): bad["activation"]}
        core.decide(step, core.candidates(step, table), table)
    assert sorted(core.fallbacks) == ["a", "b"]  # judged bad, fallen back, then what-if judged
    assert core._tracker.flags == [] and core._whatif.flags == []  # was every flag of the run
    resumed = GuardCore(core.config, core.flops)
    resumed.load_state_dict(core.state_dict())
    assert resumed._tracker.flags == [] and resumed._whatif.flags == []
