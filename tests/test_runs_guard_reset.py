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
from tests.test_guard_flops import FAULTY, INTERVAL, TOKENS, VOCAB, TiedLM

FIRST, REPROMOTE_AFTER = 12, 2


def test_after_reset_time_a_fallback_repromotes_after_repromote_after_healthy_steps(caplog):
    torch.manual_seed(0)  # one batch repeated, as test_guard_flops._fit
    tokens, labels = torch.randint(0, VOCAB, (2, TOKENS))
    data = TensorDataset(tokens.repeat(FIRST), labels.repeat(FIRST))
    model = ComposerClassifier(TiedLM(), num_classes=VOCAB)
    guard = FP8Guard(consecutive=2, max_fallback_share=0.5, repromote_after=REPROMOTE_AFTER)
    trainer = Trainer(
        model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0), seed=17,
        train_dataloader=DataLoader(data, batch_size=TOKENS), max_duration=f"{FIRST}ba",
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


def test_after_reset_time_a_logged_record_keeps_its_key():
    """A layer falls back at step 4 of the first fit (logged as fp8/guard/fallback/a), is back
    in FP8 after step 7, and falls back again at step 1 of a fit with reset_time. Loggers refuse
    a changed value under a key (W&B, MLflow: the whole queued batch dropped), so the first
    record keeps its key and the later one takes a new key. Before, the records were keyed in
    step order, and the step-1 fallback took the step-4 one's key."""
    from foundry_fp8.guard import GuardConfig, GuardCore
    from tests.test_guard import HEALTHY, UNDERFLOWING

    def table(bad: bool) -> dict:
        return {("a", t): dict(UNDERFLOWING if bad else HEALTHY) for t in ("activation",)}

    core = GuardCore(GuardConfig(consecutive=2, repromote_after=3, max_fallback_share=0.5),
                     {"a": 0.05, "b": 0.05})

    def step(number: int, bad: bool) -> None:
        t = table(bad)
        core.decide(number, core.candidates(number, t), t)
        core.repromote(number, core.ready(number, t), t)

    for number, bad in enumerate([False, False, False, True, True, False, False, False]):
        step(number, bad)
    assert [(r.step, r.fallen_at) for r in core.repromotions] == [(7, 4)]
    logged = core.records()
    for number, bad in enumerate([True, True]):  # the second fit, reset_time
        step(number, bad)
    assert [f.step for f in core.fallbacks.values()] == [1]
    now = core.records()
    assert {k: now[k] for k in logged} == logged
    assert len(now) == 3 and now[next(k for k in now if k not in logged)]["step"] == 1


def test_a_resume_after_reset_time_keeps_the_streak_of_a_layer_repromoted_before_the_reset():
    """A layer re-promoted at step 3 of the first fit is bad again at step 3 of a second fit
    (reset_time); a checkpoint there resumes the streak of the run that did not stop: the
    layer falls back at step 4, as uninterrupted. Before, the resume replayed the step-3
    re-promotion at the second fit's step 3 too (matched by step number) and forgot the bad
    streak, so the layer stayed in FP8."""
    from foundry_fp8.guard import GuardConfig, GuardCore
    from tests.test_guard import HEALTHY, UNDERFLOWING

    config = GuardConfig(consecutive=2, repromote_after=2, max_fallback_share=0.5)

    def table(bad: bool) -> dict:
        return {(layer, "activation"): dict(UNDERFLOWING if bad and layer == "a" else HEALTHY)
                for layer in ("a", "b")}

    def step(core: GuardCore, number: int, bad: bool) -> None:
        t = table(bad)
        core.decide(number, core.candidates(number, t), t)
        core.repromote(number, core.ready(number, t), t)

    straight = GuardCore(config, {"a": 0.05, "b": 0.05})
    for number, bad in enumerate([True, True, False, False]):  # fallback at 1, back after 3
        step(straight, number, bad)
    assert [(r.step, r.fallen_at) for r in straight.repromotions] == [(3, 1)]
    for number, bad in enumerate([False, False, False, True]):  # the second fit, reset_time
        step(straight, number, bad)
    resumed = GuardCore(config, {"a": 0.05, "b": 0.05})
    resumed.load_state_dict(straight.state_dict())  # the checkpoint after the second fit's 3
    for core in (straight, resumed):
        step(core, 4, True)
    assert [f.step for f in straight.fallbacks.values()] == [4]
    assert [f.step for f in resumed.fallbacks.values()] == [4]
