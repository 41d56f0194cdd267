"""fp8_guard acts on fp8_stats' logging steps only: when fp8_stats gives it none (it is off, or
its schedule has no step in the run), the guard says so once, naming why, in a real Composer
run (tests/test_guard_flops.py's model: its faulty block falls back at step 4 when judged)."""

from __future__ import annotations

import logging

import pytest

import foundry_fp8.composer.stats as stats_module
from foundry_fp8.composer.guard import FALLBACK_LAYERS
from tests.test_guard_flops import FAULTY, INTERVAL, _fit


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith("fp8_guard: fp8_stats")]


@pytest.mark.parametrize(("stats", "why"), [
    ({"layers": "nothing"},
     "fp8_stats is off: callbacks.fp8_stats.layers selects no layer (its warning above)"),
    ({"interval": 100, "start": 5},
     "fp8_stats has no logging step in this run, which ends after batch 11 "
     "(callbacks.fp8_stats.interval 100, start 5, end None)")])
def test_a_guard_fp8_stats_gives_nothing_says_so_once(tmp_path, caplog, stats, why):
    guard, series, hparams = _fit(tmp_path, 0.5, caplog, **stats)
    assert _said(caplog) == [f"fp8_guard: {why}, so fp8_guard judges nothing from now on in "
                             "this run and moves no layer"]
    assert series == {} and not guard.core.fallbacks
    assert not [k for k in hparams if k.startswith("fp8/guard/")]


def test_a_guard_whose_fp8_stats_fails_mid_run_says_so_once(tmp_path, caplog, monkeypatch):
    """fp8_stats switches itself off after its own error at the third logging step, after the
    guard moved the faulty block there: the guard's series stop, the block stays in fallback."""
    calls = []
    rows = stats_module.heatmap_rows

    def failing(table):
        calls.append(table)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return rows(table)

    monkeypatch.setattr(stats_module, "heatmap_rows", failing)
    guard, series, _ = _fit(tmp_path, 0.5, caplog)
    assert _said(caplog) == [
        "fp8_guard: fp8_stats switched itself off after an error (its message above), so "
        "fp8_guard judges nothing from now on in this run and moves no layer; the 1 layer(s) in "
        "fallback stay in high precision"]
    assert list(guard.core.fallbacks) == [FAULTY]
    assert {step: logged[FALLBACK_LAYERS] for step, logged in series.items()} == {
        0: 0.0, INTERVAL: 0.0, 2 * INTERVAL: 1.0}
