"""`health.loss.spike`, the report's loss line without a baseline: what it takes for a spike
(more than LOSS_SPIKE_RATIO times the median of the losses just before, or NaN/Inf), and what
it leaves alone (a noisy decreasing loss, a noisy step among small losses)."""

from __future__ import annotations

import math
import random

import pytest

from foundry_fp8.health.loss import spike
from foundry_fp8.health.thresholds import LOSS_SPIKE_MIN, LOSS_SPIKE_RATIO, LOSS_SPIKE_WINDOW


def _decreasing(steps: int, noise: float, seed: int) -> dict[int, float]:
    """A pretraining-like loss: from ln(50k) down toward 2.5, each step off by up to `noise`
    (relative), seeded."""
    rng = random.Random(seed)
    return {s: (2.5 + (math.log(50_000) - 2.5) * math.exp(-s / 300))
            * (1 + rng.uniform(-noise, noise)) for s in range(steps)}


@pytest.mark.parametrize("seed", range(5))
def test_a_noisy_decreasing_loss_has_no_spike(seed):
    losses = _decreasing(3000, 0.3, seed)
    assert sum(losses[s + 1] > losses[s] for s in range(2999)) > 1000  # noisy indeed
    found = spike(losses)
    assert found.step is None and (found.first, found.last) == (0, 2999)


@pytest.mark.parametrize("factor, spikes", [(0.95, False), (1.05, True)])
def test_a_jump_spikes_above_the_ratio_of_the_median_before(factor, spikes):
    losses = _decreasing(500, 0.05, 0)
    median = sorted(losses[s] for s in range(400 - LOSS_SPIKE_WINDOW, 400))
    middle = (median[LOSS_SPIKE_WINDOW // 2 - 1] + median[LOSS_SPIKE_WINDOW // 2]) / 2
    losses[400] = factor * LOSS_SPIKE_RATIO * middle
    found = spike(losses)
    assert found.step == (400 if spikes else None)
    if spikes:
        assert found.median == pytest.approx(middle) and found.over == LOSS_SPIKE_WINDOW
        assert found.loss == losses[400]


def test_nan_or_inf_spikes_at_once_and_a_jump_needs_losses_before_it():
    early = {s: 3.0 for s in range(20)}
    early[LOSS_SPIKE_MIN - 1] = 100.0  # too few losses before it for a median
    assert spike(early).step is None
    early[1] = math.nan
    found = spike(early)
    assert (found.step, found.median, found.over) == (1, None, 1) and math.isnan(found.loss)


def test_the_steps_are_taken_in_order_not_as_logged():
    losses = {s: 3.0 for s in range(10, 0, -1)}
    losses[7] = math.inf
    assert spike(losses).step == 7 and spike(losses).first == 1
