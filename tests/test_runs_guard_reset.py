"""fp8_guard across `Trainer.fit(reset_time=True)`: the second fit's steps start at 0 again, so a
layer that fell back in the first fit is judged on its what-if statistics from the second fit's
first logging step; before, its re-promotion waited until the new steps passed the old
fallback's step number (a layer that fell back at step 10 waited 5 healthy logging steps, not
`repromote_after` 2)."""

from __future__ import annotations

import logging

import torch
from composer import Trainer
from composer.models import ComposerClassifier
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from tests.test_guard_flops import FAULTY, INTERVAL, VOCAB, TiedLM

FIRST, REPROMOTE_AFTER = 12, 2


def test_after_reset_time_a_fallback_repromotes_after_repromote_after_healthy_steps(caplog):
    torch.manual_seed(0)
    data = TensorDataset(torch.randint(0, VOCAB, (8 * FIRST,)),
                         torch.randint(0, VOCAB, (8 * FIRST,)))
    model = ComposerClassifier(TiedLM(), num_classes=VOCAB)
    guard = FP8Guard(consecutive=2, max_fallback_share=0.34, repromote_after=REPROMOTE_AFTER)
    trainer = Trainer(
        model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0), seed=17,
        train_dataloader=DataLoader(data, batch_size=8), max_duration=f"{FIRST}ba",
        algorithms=[TESwap(backend="emulate")],
        callbacks=[FP8Stats(interval=INTERVAL, image_interval=None), guard], device="cpu",
        progress_bar=False)
    trainer.fit()
    (fallback,) = guard.core.fallbacks.values()
    assert fallback.layer == FAULTY
    fallen_at = fallback.step
    assert fallen_at >= REPROMOTE_AFTER * INTERVAL  # late enough for the old code to wait
    with torch.no_grad():  # the fault ends: its huge weight element goes
        model.module.blocks[0].weight[0, 0] = 0.0
    with caplog.at_level(logging.WARNING):
        trainer.fit(duration=f"{FIRST}ba", reset_time=True)
    trainer.close()
    (repromoted,) = guard.core.repromotions
    # healthy what-if statistics at steps 0 and 2 of the second fit: back in FP8 after step 2
    assert (repromoted.layer, repromoted.fallen_at) == (FAULTY, fallen_at)
    assert repromoted.step == (REPROMOTE_AFTER - 1) * INTERVAL
    assert f"runs in FP8 again from step {repromoted.step + 1}" in caplog.text
