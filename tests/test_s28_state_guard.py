"""fp8_guard's fallbacks in a checkpoint, loaded where the guard cannot restore them, through
Composer's own save and load: a weights-only load (fine-tuning from a run whose guard held
layers in high precision) put them back in FP8 without a word, and a resume without fp8_guard
that excludes a held layer (the guard's advice) said that layer runs in FP8 again."""

from __future__ import annotations

import functools
import logging

from composer.core import Callback

from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.state import FP8State
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.fault import InjectOutlier
from tests.test_state_restore import LOGGER, _checkpoint, _ours
from tests.test_state_restore import _trainer as _run


def _guarded() -> list[Callback]:
    return [FP8State(), FP8Stats(interval="1ba"), FP8Guard(consecutive=1, max_fallback_share=1.0)]


def _held_both(folder) -> str:
    """A checkpoint whose fp8_guard holds both blocks in high precision (the outlier reaches
    both)."""
    _run(folder, "2ba", [*_guarded(), InjectOutlier(layer="blocks.1", start=0)]).fit()
    return str(_checkpoint(folder, 2))


def test_a_weights_only_load_says_the_held_layers_run_in_fp8_again(tmp_path, caplog):
    checkpoint = _held_both(tmp_path)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _run(tmp_path / "tuned", "3ba", _guarded(), load_path=checkpoint, load_weights_only=True)
    assert _ours(caplog) == [
        f"fp8_state: {checkpoint} loaded with load_weights_only: FP8 scales and amax histories "
        "are not part of the model's weights and start fresh (a full load restores them)",
        f"fp8_state: {checkpoint}: fp8_guard held 2 layers in high precision (module.blocks.0, "
        "module.blocks.1); a weights-only load does not keep its fallbacks, so they run in FP8 "
        "again"]


def test_a_held_layer_excluded_since_is_not_said_to_run_in_fp8_again(tmp_path, caplog,
                                                                     monkeypatch):
    checkpoint = _held_both(tmp_path)
    # the resumed run's te_swap excludes blocks.1, as the guard's advice for it says
    monkeypatch.setattr("tests.test_state_restore.TESwap",
                        functools.partial(TESwap, exclude=r"blocks\.1"))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        _run(tmp_path / "resumed", "3ba", [FP8State()], load_path=checkpoint)
    assert _ours(caplog) == [
        f"fp8_state: {checkpoint}: fp8_guard held 1 layer in high precision (module.blocks.0); "
        "this run has no fp8_guard, so they run in FP8 again"]
    assert ("fp8_state: not in FP8 in this run, and in high precision at the checkpoint by "
            "fp8_guard's fallback: module.blocks.1; their saved FP8 state is left out"
            in caplog.text)
