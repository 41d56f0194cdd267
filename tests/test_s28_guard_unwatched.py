"""fp8_guard judges only what fp8_stats gives it at its logging steps. Two ways a user's
fp8_stats options leave FP8 layers unguarded while the guard said nothing: an `end` that stops
fp8_stats' logging steps before the run ends (the guard had heard a step, so it never said it
was left with none), and `layers`/`exclude` that watch only some FP8 layers (the others are
never judged). Real Composer runs of tests/test_guard_flops.py's model, whose faulty block
`module.blocks.0` falls back at step 4 when judged (logging steps every 2 batches)."""

from __future__ import annotations

import logging

import pytest

from foundry_fp8.composer.guard import FALLBACK_LAYERS, FP8Guard
from foundry_fp8.options import OptionError
from tests.test_guard_flops import FAULTY, INTERVAL, _fit


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith("fp8_guard: fp8_stats")]


def test_a_schedule_ending_before_the_run_is_said_once_when_its_last_step_is_past(tmp_path,
                                                                                   caplog):
    """`end: 3`: logging steps 0 and 2 only, of a 12-batch run; the faulty block, judged from
    step 2 on (delayed scaling's first cast is not), would fall back at step 4, so it stays in
    FP8: the guard says so once, after step 2."""
    guard, series, _ = _fit(tmp_path, 0.5, caplog, end=3)
    assert sorted(series) == [0, INTERVAL]
    assert not guard.core.fallbacks
    assert _said(caplog) == [
        "fp8_guard: fp8_stats has no logging step left in this run after step 2 "
        "(callbacks.fp8_stats.end 3; the run ends after batch 11), so fp8_guard judges nothing "
        "from now on in this run and moves no layer"]


def test_a_schedule_whose_last_step_is_the_runs_says_nothing(tmp_path, caplog):
    """Without `end`, the steps after the last logging step of the run are no reason to warn;
    nor is an `end` past the run's last batch."""
    for end in (None, 40):
        caplog.clear()
        guard, series, _ = _fit(tmp_path / str(end), 0.5, caplog, end=end)
        assert list(guard.core.fallbacks) == [FAULTY]
        assert series[2 * INTERVAL][FALLBACK_LAYERS] == 1.0
        assert _said(caplog) == [] and not [r for r in caplog.records if any(
            words in r.getMessage() for words in ("does not watch", "fewer than"))]


def test_fp8_layers_fp8_stats_does_not_watch_are_named_at_fit_start(tmp_path, caplog):
    """`layers: blocks\\.1`: the faulty block is never judged, and the guard names it."""
    guard, series, _ = _fit(tmp_path, 0.5, caplog, layers=r"blocks\.1")
    assert not guard.core.fallbacks
    assert series[2 * INTERVAL][FALLBACK_LAYERS] == 0.0
    said = [r.getMessage() for r in caplog.records if "does not watch" in r.getMessage()]
    assert said == [
        "fp8_guard: fp8_stats does not watch 1 of the 2 layers in FP8 (its callbacks.fp8_stats"
        ".layers/exclude), so fp8_guard never judges or moves them: module.blocks.0"]


def test_fewer_logging_steps_than_consecutive_is_said_at_fit_start(tmp_path, caplog):
    """`interval: 12` in a 12-batch run: one logging step (0), `consecutive: 2` never reached,
    the faulty block never moved; said once, at fit start."""
    guard, series, _ = _fit(tmp_path, 0.5, caplog, interval=12, image_interval=None)
    assert sorted(series) == [0] and not guard.core.fallbacks
    assert [r.getMessage() for r in caplog.records if "fewer than" in r.getMessage()] == [
        "fp8_guard: fp8_stats has 1 logging step(s) left in this run (it ends after batch 11; "
        "callbacks.fp8_stats.interval 12, start 0, end None), fewer than "
        "callbacks.fp8_guard.consecutive 2, so no layer can fall back in it: lower one of them"]


def test_tensors_fp8_stats_does_not_watch_are_said_at_fit_start(tmp_path, caplog):
    """`tensors: [activation, gradient]`: the faulty block's weight is never judged."""
    guard, series, _ = _fit(tmp_path, 0.5, caplog, tensors=["activation", "gradient"])
    assert not guard.core.fallbacks
    assert series[2 * INTERVAL][FALLBACK_LAYERS] == 0.0
    assert [r.getMessage() for r in caplog.records if "does not watch" in r.getMessage()] == [
        "fp8_guard: fp8_stats does not watch the weight of any layer (its callbacks.fp8_stats"
        ".tensors ['activation', 'gradient']), so fp8_guard never judges them: a layer whose FP8 "
        "weight fails stays in FP8"]


def test_a_failing_check_of_what_fp8_stats_watches_leaves_the_guard_on(tmp_path, caplog,
                                                                        monkeypatch):
    """Those checks are warnings: an error in them (our bug) is said, the guard still acts."""
    import foundry_fp8.composer.guard as guard_module

    def failing(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(guard_module, "select_layers", failing)
    guard, series, _ = _fit(tmp_path, 0.5, caplog)
    assert list(guard.core.fallbacks) == [FAULTY]
    assert series[2 * INTERVAL][FALLBACK_LAYERS] == 1.0
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        "fp8_guard: internal error checking what fp8_stats gives it"]


def test_with_the_guard_before_fp8_stats_a_stats_selecting_nothing_is_said_once(
        tmp_path, caplog, monkeypatch):
    """The guard listed before fp8_stats starts before fp8_stats switches itself off for
    `layers: nothing`: only the guard's line that fp8_stats is off, not also that it watches
    none of the FP8 layers."""
    import composer

    trainer = composer.Trainer

    def guard_first(*args, callbacks, **kwargs):
        return trainer(*args, callbacks=callbacks[::-1], **kwargs)

    monkeypatch.setattr(composer, "Trainer", guard_first)
    _fit(tmp_path, 0.5, caplog, layers="nothing")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("fp8_guard: ")
            and r.levelno == logging.WARNING] == [
        "fp8_guard: fp8_stats is off: callbacks.fp8_stats.layers selects no layer (its warning "
        "above), so fp8_guard judges nothing from now on in this run and moves no layer"]


def test_two_guards_in_one_trainer_are_refused_in_one_line(tmp_path, caplog, monkeypatch):
    """A second FP8Guard (added in Python: LLM-Foundry's YAML holds one entry per name)
    judged the layer the first moved by its what-if numbers, "moved" it again two logging
    steps later and logged a second, different `fp8/guard/fallback/<layer>` record."""
    import composer

    trainer = composer.Trainer

    def two_guards(*args, callbacks, **kwargs):
        return trainer(*args, callbacks=[*callbacks, FP8Guard(consecutive=3)], **kwargs)

    monkeypatch.setattr(composer, "Trainer", two_guards)
    with pytest.raises(OptionError) as refused:
        _fit(tmp_path, 0.5, caplog)
    assert str(refused.value) == (
        "callbacks.fp8_guard: is given twice to this Trainer (two FP8Guard callbacks): each "
        "would move the other's layers in fallback again, by their what-if statistics, and log "
        "conflicting records under the same keys (fix: keep one fp8_guard)")
