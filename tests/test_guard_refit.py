"""A second `Trainer.fit()` in the same process (more batches, or `reset_time=True`) keeps
fp8_guard's fallbacks, as a resume does: the layer stays in high precision, the series keep
counting it and its record keeps the step that decided it (tests/test_guard_flops.py's model:
its faulty block falls back at step 4 and stays faulty)."""

from __future__ import annotations

import logging

import pytest

from foundry_fp8.composer.guard import FALLBACK_LAYERS
from tests.test_guard_flops import BATCHES, FAULTY, INTERVAL, _fit


@pytest.mark.parametrize("refit", [{"duration": "6ba"}, {"duration": "6ba", "reset_time": True}],
                         ids=["more_batches", "reset_time"])
def test_a_second_fit_keeps_the_fallbacks_of_the_first(tmp_path, caplog, refit):
    guard, series, hparams = _fit(tmp_path, 0.34, caplog, refit=refit)
    second = range(0, 6, INTERVAL) if "reset_time" in refit else range(BATCHES, BATCHES + 6,
                                                                        INTERVAL)
    assert {step: series[step][FALLBACK_LAYERS] for step in second} == dict.fromkeys(second, 1.0)
    assert hparams[f"fp8/guard/fallback/{FAULTY}"]["step"] == 2 * INTERVAL
    assert [k for k in hparams if k.startswith("fp8/guard/fallback/")] == [
        f"fp8/guard/fallback/{FAULTY}"]
    assert f"fp8_guard: a new fit() keeps {FAULTY} in high precision" in [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert list(guard.core.fallbacks) == [FAULTY]
