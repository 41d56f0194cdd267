"""A resume that follows fp8_guard's own advice: the fallback's warning gives the te_swap
`exclude` that keeps the layer in high precision "from the start next time", and a user who
puts it in the YAML and resumes the run from its checkpoint found

- fp8_state refusing the resume under its default `strict` (the layer's saved FP8 state "saved,
  not in FP8 now"), although the layer ran in high precision at the checkpoint already;
- fp8_guard counting the old fallback against this run's FP8 FLOPs a second time: its series
  `fp8/guard/fp8_flops_share` read 0 % with one layer still in FP8, its budget was spent (a
  real fallback later was refused), and with `repromote_after` its what-if rows could "put it
  back in FP8" while te_swap kept it out.

The model is test_guard_flops' without its TE stand-in (`native`): a TE module outside
Composer's `amp_fp8` holds no FP8 state to save, and fp8_state names it "in FP8 now without
saved state" at every resume (reported, not changed here)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.guard import FP8_FLOPS_SHARE, FP8Guard
from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.state import FP8State
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.guard import GuardConfig, GuardCore, exclude_regex
from foundry_fp8.jsonl import read_jsonl
from tests.test_guard import HEALTHY, UNDERFLOWING
from tests.test_guard_flops import FAULTY, INTERVAL, TOKENS, VOCAB, TiedLM

FIRST, SECOND = 6, 8  # batches: the fallback is decided at step 4, the checkpoint is at 6


def test_a_fallback_outside_this_runs_fp8_layers_spends_no_share_and_is_never_repromoted():
    """The checkpoint's fallback of `a` (20 % of the FLOPs), `a` excluded by te_swap now: the
    shares are of `b` and `c`, so `b` falls back within a budget of 50 % (before: refused, the
    fallbacks already taking 0.2 / 0.2 = 100 %), and `a`'s healthy what-if rows never make it
    ready."""
    config = GuardConfig(consecutive=1, max_fallback_share=0.5, repromote_after=1)
    before = GuardCore(config, {"a": 0.2, "b": 0.1, "c": 0.1})
    table = {(layer, "weight"): dict(UNDERFLOWING if layer == "a" else HEALTHY)
             for layer in "abc"}
    before.decide(2, before.candidates(2, table), table)
    assert list(before.fallbacks) == ["a"]
    core = GuardCore(config, {"b": 0.1, "c": 0.1})
    core.load_state_dict(before.state_dict())
    assert core.held == [] and list(core.fallbacks) == ["a"]  # its record stays
    assert core.fp8_flops_share == pytest.approx(0.2) and core.fallback_share == 0.0
    healthy = {(layer, "weight"): dict(HEALTHY) for layer in "abc"}
    for step in (4, 6):
        assert core.candidates(step, healthy) == [] and core.ready(step, healthy) == []
    bad_b = {**healthy, ("b", "weight"): dict(UNDERFLOWING)}
    verdict = core.decide(8, core.candidates(8, bad_b), bad_b)
    assert [f.layer for f in verdict.fallbacks] == ["b"] and not verdict.refused
    assert core.fp8_flops_share == pytest.approx(0.1) and core.fallback_share == pytest.approx(0.5)


class _Model(TiedLM):
    """Without the TE stand-in: two te_swap blocks and the tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.native = torch.nn.Identity()


def _trainer(folder, batches: int, exclude: str | None = None, load: str | None = None,
             strict: bool = False):
    from composer import Trainer
    from composer.models import ComposerClassifier

    torch.manual_seed(0)
    tokens, labels = torch.randint(0, VOCAB, (2, TOKENS))
    data = TensorDataset(tokens.repeat(SECOND), labels.repeat(SECOND))
    model = ComposerClassifier(_Model(), num_classes=VOCAB)
    guard = FP8Guard(consecutive=2, max_fallback_share=0.5, strict=strict)
    swap = TESwap(backend="emulate", **({"exclude": exclude} if exclude else {}))
    trainer = Trainer(
        model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0), seed=17,
        run_name="run", train_dataloader=DataLoader(data, batch_size=TOKENS),
        max_duration=f"{batches}ba", algorithms=[swap], device="cpu", progress_bar=False,
        callbacks=[FP8Stats(interval=INTERVAL, image_interval=None), guard, FP8State()],
        loggers=[JSONLLogger(path=str(folder / "metrics.jsonl"))],
        save_folder=str(folder / "checkpoints"), save_interval=f"{FIRST}ba", load_path=load)
    return trainer, guard


def test_a_resume_with_the_fallbacks_own_exclude_resumes_and_counts_shares_of_this_run(
        tmp_path, caplog):
    first, guard = _trainer(tmp_path / "first", FIRST)
    first.fit()
    first.close()
    assert list(guard.core.fallbacks) == [FAULTY]
    kept = {k: v.clone() for k, v in read_fp8_meta(first.state.model.module.blocks[1]).items()}
    checkpoint = str(tmp_path / "first" / "checkpoints" / f"ep0-ba{FIRST}-rank0.pt")
    with caplog.at_level(logging.INFO, logger="foundry_fp8"):
        # the YAML the fallback's warning gives (`static_yaml`), under fp8_state's strict
        second, guard = _trainer(tmp_path / "second", SECOND, exclude_regex([FAULTY]),
                                 checkpoint)
        restored = read_fp8_meta(second.state.model.module.blocks[1])
        assert restored.keys() == kept.keys() and all(
            torch.equal(restored[k], kept[k]) for k in kept)  # the layer still in FP8
        second.fit()
        second.close()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("foundry_fp8.composer")]
    assert not [m for m in said if "differ from this run's" in m]
    [left_out] = [m for m in said if "fp8_guard's fallback" in m]
    assert f"{FAULTY}; their saved FP8 state is left out" in left_out
    [gone] = [m for m in said if "not in FP8 in this run (te_swap's" in m]
    assert gone.startswith(f"fp8_guard: {FAULTY} (in fallback before)")
    # the guard's share is te_swap's: the one FP8 block left (was 0 %: the fallback counted
    # against a total that no longer held it)
    hparams = json.loads((tmp_path / "second" / "hparams.json").read_text())
    shares = [m[FP8_FLOPS_SHARE] for _, m in read_jsonl(tmp_path / "second" / "metrics.jsonl")
              if FP8_FLOPS_SHARE in m]
    assert shares and all(s == pytest.approx(hparams["fp8/linear_flops_share"]) for s in shares)
    assert hparams["fp8/linear_flops_share"] > 0
    assert guard.core.fallback_share == 0.0 and list(guard.core.fallbacks) == [FAULTY]
