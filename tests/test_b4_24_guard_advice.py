"""fp8_guard's fallback reasons give the advice fp8_stats' warnings give (QA B4 s24, after
fc15195, 2eafa2d, 5338149): the keep-in-BF16 change names te_swap's edge blocks counted over the
whole model (the guard judges only the layers fp8_stats watches), and the persistent-overflow
change raises the margin the FP8 layers cast with by one. Each change is followed as a user
follows it: given to te_swap's own plan (`swap.plan_swap`), or the run cast again with it."""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch
import yaml
from torch import nn

from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.guard import GuardConfig, GuardCore, fallback_message
from foundry_fp8.health.rules import model_blocks
from foundry_fp8.options import SwapConfig
from foundry_fp8.recipe import FP8Recipe
from tests.three_blocks import ThreeBlocks, kept_by_te_swap

OVERFLOW = "keeps outgrowing its delayed scale"
def _changes(message: str) -> list[dict[str, object]]:
    """The te_swap options a fallback line's reasons tell the user to set, each read with a YAML
    reader as the user's config is (`fp8_recipe.margin` dotted)."""
    reasons = message.split(": ", 1)[1].split(". To run it so from the start", 1)[0]
    changes = []
    for reason in reasons.split(" | "):
        [(path, value)] = yaml.safe_load(reason.rsplit("Change: ", 1)[1]).items()
        assert path.startswith(f"{SwapConfig.PATH}."), message
        changes.append({path.removeprefix(f"{SwapConfig.PATH}."): value})
    return changes

def test_a_middle_block_judged_last_is_told_its_own_exclude():
    """fp8_stats watching blocks 0 and 1 of 3 (`layers: 'blocks\\.[01]\\.'`): the guard judges
    those two; block 1's underflow over the limit names its own exclude, which te_swap follows
    by keeping block 1's layer (keep_last_blocks: 1 kept block 2's)."""
    model = ThreeBlocks()
    config = GuardConfig(consecutive=1, max_fallback_share=1.0)
    core = GuardCore(config, {"blocks.0.fc": 0.25, "blocks.1.fc": 0.25},
                     model_blocks(n for n, _ in model.named_modules(remove_duplicate=False)))
    over = config.max_underflow_pct + 10
    table = {("blocks.0.fc", "weight"): {"underflow_pct": 0.0},
             ("blocks.1.fc", "weight"): {"underflow_pct": over}}
    [fallback] = core.decide(0, core.candidates(0, table), table).fallbacks
    assert fallback.layer == "blocks.1.fc"
    [change] = _changes(fallback_message(fallback, "<yaml>"))
    assert change == {"exclude": r"^(?:model\.)?(?:transformer\.)?blocks\.1\.fc(?:\..+)?$"}, fallback.reasons  # was keep_last_blocks: 1
    assert kept_by_te_swap(model, change) == {"blocks.1.fc"}
    assert kept_by_te_swap(model, {"keep_last_blocks": 1}) == {"blocks.2.fc"}  # the old advice
    # block 0 is te_swap's first block whatever the guard judges
    core = GuardCore(config, {"blocks.0.fc": 0.25}, core.blocks)
    table = {("blocks.0.fc", "weight"): {"underflow_pct": over}}
    [fallback] = core.decide(0, core.candidates(0, table), table).fallbacks
    [change] = _changes(fallback_message(fallback, "<yaml>"))
    assert change == {"keep_first_blocks": 1}
    assert kept_by_te_swap(model, change) == {"blocks.0.fc"}
def _guarded_fallbacks(model: nn.Module, margin: int, batch: Callable[[int], torch.Tensor],
                       steps: int = 6) -> list[str]:
    """fp8_stats watching blocks 0 and 1 of 3 (`layers: 'blocks\\.[01]\\.'`, every batch) and
    fp8_guard (one flagged step moves a layer) as Composer runs their events, the model under
    emulated delayed scaling at `margin`; the guard's fallback lines."""
    from composer.core import Event
    from composer.devices import DeviceCPU

    callbacks = [FP8Stats(interval=1, layers=r"blocks\.[01]\."),
                 FP8Guard(consecutive=1, max_fallback_share=1.0)]
    state = types.SimpleNamespace(model=model, run_name="run", callbacks=callbacks,
                                  algorithms=[], device=DeviceCPU(),
                                  precision=types.SimpleNamespace(value="fp32"),
                                  timestamp=types.SimpleNamespace(batch=0))

    class Destination:
        log_metrics = log_images = log_table = log_hyperparameters = staticmethod(
            lambda *a, **k: None)

    logger = types.SimpleNamespace(destinations=[Destination()])
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    watched = logging.getLogger("foundry_fp8.composer.guard")
    watched.addHandler(handler)
    recipe = FP8Recipe(scaling="delayed", amax_history_len=16, amax_compute_algo="max",
                       margin=margin)
    try:
        for callback in callbacks:
            callback.run_event(Event.FIT_START, state, logger)
        for step in range(steps):
            state.timestamp.batch = step
            for callback in callbacks:
                callback.run_event(Event.BATCH_START, state, logger)
            with fp8_autocast(recipe=recipe):
                model(batch(step)).sum().backward()
            state.timestamp.batch = step + 1
            for event in (Event.AFTER_TRAIN_BATCH, Event.BATCH_END):
                for callback in callbacks:
                    callback.run_event(event, state, logger)
    finally:
        watched.removeHandler(handler)
    return [line for line in lines if "runs in high precision from step" in line]


def test_the_callback_judges_with_the_models_blocks():
    """An outlier weight element in block 1 flushes the rest of its weight under FP8: the
    guard moves blocks.1.fc and its line names blocks.1.fc's own exclude, which te_swap follows
    (the guard judged blocks 0 and 1 only: keep_last_blocks: 1 kept blocks.2.fc instead)."""
    model = ThreeBlocks(EmulatedFP8Linear)
    with torch.no_grad():
        model.blocks[1].fc.weight[0, 0] = 1e6
    base = torch.randn(16, 16)
    lines = _guarded_fallbacks(model, 0, lambda step: base)
    [line] = [line for line in lines if line.startswith("fp8_guard: layer 'blocks.1.fc'")]
    changes = _changes(line)
    assert {"exclude": r"^(?:model\.)?(?:transformer\.)?blocks\.1\.fc(?:\..+)?$"} in changes, line
    assert not [c for c in changes if "keep_last_blocks" in c], line
    assert kept_by_te_swap(ThreeBlocks(), {"exclude": r"^(?:model\.)?(?:transformer\.)?blocks\.1\.fc(?:\..+)?$"}) == {"blocks.1.fc"}


def _overflow_lines(margin: int, growth: float = 3.0) -> list[str]:
    torch.manual_seed(0)
    base = torch.randn(16, 16)
    return [line for line in _guarded_fallbacks(ThreeBlocks(EmulatedFP8Linear), margin,
                                                lambda step: base * growth**step)
            if OVERFLOW in line]


def test_the_callback_raises_the_margin_its_layers_cast_with():
    """The input grows 3x a step: at margin 1 the delayed scale (TE's: (fp8_max / amax) /
    2**margin) trails block 0's activation by 3 / 2 a step, so it overflows, and the guard's
    line tells margin: 2, the run's own + 1 (was margin: 1, the run's own). Followed: at
    margin 2 the same growth overflows no scale (test_b2_24_live_advice's numbers)."""
    lines = _overflow_lines(1)
    assert lines
    for line in lines:
        assert {"fp8_recipe.margin": 2} in _changes(line), line
    assert not _overflow_lines(2)
