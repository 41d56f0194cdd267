"""fp8_stats' summary series at a step where no layer counts: delayed scaling's first cast (the
initial scale 1, left out by design) at step 0, or every layer in fp8_guard's fallback. The
`worst_*` keys are then not logged at all: 1.0 (cos_sim) and 0.0 (underflow) read as a perfect
cast while the per-layer values say otherwise.

Reference: torch's own float8_e4m3fn cast of the activation with scale 1 (the initial delayed
scale: TE multiplies by the scale and casts, saturating), the share of nonzero elements that come
back 0, and the cosine similarity of the dequantized values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.health import layer_key, summary_key
from foundry_fp8.monitor import FP8Monitor, MonitorConfig
from foundry_fp8.recipe import FP8Recipe

D = 16
WORST = ("worst_underflow_pct", "worst_overflow_pct", "worst_cos_sim")


def _e4m3_scale_1(t: torch.Tensor) -> tuple[float, float]:
    """(underflow %, cos_sim) of casting `t` to E4M3 with scale 1."""
    q = t.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).double()
    nonzero = t != 0
    underflow = 100.0 * float(((q == 0) & nonzero).sum()) / float(nonzero.sum())
    cos = float(torch.nn.functional.cosine_similarity(q.flatten(), t.double().flatten(), dim=0))
    return underflow, cos


def _run(fallbacks: set[str]) -> list[dict[str, float]]:
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(D, D, bias=False))
    monitor = FP8Monitor(model, MonitorConfig(), on_warning=lambda _: None)
    # the activation: half its elements below E4M3's smallest subnormal (2^-9) at scale 1
    x = torch.cat([torch.full((4, D), 1e-4), torch.full((4, D), 0.5)])
    steps = []
    for _ in range(2):
        monitor.start_step()
        with fp8_autocast(recipe=FP8Recipe(scaling="delayed")):
            if fallbacks:
                with fp8_autocast(enabled=False):
                    y = model(x)
            else:
                y = model(x)
        y.sum().backward()
        steps.append(monitor.finish_step(fallbacks=fallbacks))
    return steps


def test_no_worst_summary_at_the_step_whose_casts_all_use_the_initial_scale():
    first, second = _run(set())
    x = torch.cat([torch.full((4, D), 1e-4), torch.full((4, D), 0.5)])
    underflow, cos = _e4m3_scale_1(x)
    assert underflow == pytest.approx(50.0)
    # the per-layer series show the first cast as it was...
    assert first[layer_key("underflow_pct", "activation", "0")] == pytest.approx(underflow)
    assert first[layer_key("cos_sim", "activation", "0")] == pytest.approx(cos, abs=1e-6)
    # ... the summary does not pretend it was perfect: no worst value, no flag
    for tensor in ("activation", "weight", "gradient"):
        for name in WORST:
            assert summary_key(tensor, name) not in first
        assert first[summary_key(tensor, "flagged_layers")] == 0.0
        assert summary_key(tensor, "nonfinite") in first
    # the next step casts with a scale from a recorded amax: its worst values are logged
    assert all(summary_key(t, name) in second for t in ("activation", "weight", "gradient")
               for name in WORST)
    assert second[summary_key("activation", "worst_underflow_pct")] == (
        second[layer_key("underflow_pct", "activation", "0")])


def test_no_worst_summary_when_every_layer_is_in_fallback():
    for metrics in _run({"0"}):
        assert layer_key("underflow_pct", "activation", "0") in metrics
        assert not [key for key in metrics if key.rpartition("/")[2] in WORST]
        assert metrics[summary_key(None, "flagged_layers")] == 0.0
