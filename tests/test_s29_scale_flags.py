"""`foundry-fp8 report` keeps every flag its replay raises (the tables count and rank them): a
long run whose gradients underflow at every logging step raises one flag per gradient and
step, 512,000 for an MPT-7B's 128 over 4,000 logging steps. Each flag held its own copies of
its texts (limit, cause, change) in an instance dict, about 430 bytes; MPT-1B's 50k steps with
every gradient flagged took 60 MiB more than unflagged (benchmarks/report_scale.py). A flag now
shares its texts with the others of its rule and layer and holds no dict. Memory is counted
with tracemalloc (deterministic), not timed."""

from __future__ import annotations

import tracemalloc

from foundry_fp8.health.rules import HealthTracker

LAYERS = [f"blocks.{b}.{part}" for b in range(8) for part in ("attn.Wqkv", "ffn.up_proj")]
STEPS = 200


def _table(step: int) -> dict[tuple[str, str], dict[str, float]]:
    """Every gradient 8 % underflow (over the 5 % limit), at a scale_ratio that is no stale
    scale: the `underflow` rule, once a step per layer."""
    return {(layer, "gradient"): {"underflow_pct": 8.0 + step / 1000, "overflow_pct": 0.0,
                                  "cos_sim": 0.999, "scale_ratio": 1.0, "amax": 1e-3}
            for layer in LAYERS}


def test_a_flag_raised_at_every_step_holds_no_copy_of_its_texts():
    tracker = HealthTracker()
    tracker.update(0, _table(0))  # first flags and the tracker's state, before counting
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for step in range(1, STEPS + 1):
            tracker.update(step, _table(step))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    raised = tracker.flags[len(LAYERS):]
    assert len(raised) == STEPS * len(LAYERS)
    assert {f.rule for f in raised} == {"underflow"}
    assert [f.value for f in raised[-len(LAYERS):]] == [8.0 + STEPS / 1000] * len(LAYERS)
    assert raised[-1].limit == "> 5 %" and raised[-1].step == STEPS
    assert held / len(raised) < 250, f"{held / len(raised):.0f} bytes a flag"
