"""A run resumed from a checkpoint into its own folder (hparams.json, metrics.jsonl) with a layer
already in fallback: fp8_guard logs the kept records again at the start (`_log_records`), so the
report gives the span open at the resumed run's first logging step its record (its step and
reasons) and its re-promotion's record, not a made-up fallback at the step before with "no
record in the hyperparameters"."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from composer import Callback, Trainer
from composer.models import ComposerClassifier
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.fault import InjectOutlier
from foundry_fp8.guard import FALLBACK_PREFIX, REPROMOTION_PREFIX
from foundry_fp8.report.cli import make_report
from tests.test_state_restore import TwoBlocks

SAVED, BATCHES = 8, 16  # the fault at batches 3-4; the first run saves at SAVED and stops
LAYER = "module.blocks.1"


class Hooked(Callback):
    """The batches the guard ran LAYER in high precision (its hooks)."""

    def __init__(self, guard: FP8Guard):
        self.guard, self.batches = guard, set()

    def batch_start(self, state, logger) -> None:
        if LAYER in self.guard._handles:
            self.batches.add(int(state.timestamp.batch))


def _run(folder: Path, load: str | None) -> Hooked:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 16).repeat(BATCHES, 1),
                         torch.randint(0, 16, (8,)).repeat(BATCHES))
    model = ComposerClassifier(TwoBlocks(), num_classes=16)
    guard = FP8Guard(consecutive=1, repromote_after=6, max_fallback_share=1.0)
    hooked = Hooked(guard)
    trainer = Trainer(
        model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0), seed=17,
        run_name="carried", train_dataloader=DataLoader(data, batch_size=8),
        max_duration=f"{BATCHES if load else SAVED}ba", algorithms=[TESwap(backend="emulate")],
        callbacks=[FP8Stats(interval=1, image_interval=None), guard, hooked,
                   InjectOutlier(LAYER, start=3, stop=5)],
        loggers=[JSONLLogger(path=str(folder / "metrics.jsonl"))], device="cpu",
        progress_bar=False, save_folder=str(folder / "checkpoints"),
        save_interval=f"{SAVED}ba", load_path=load)
    trainer.fit()
    trainer.close()
    return hooked


def test_a_fallback_open_at_a_resumed_runs_first_step_has_its_record(tmp_path):
    first = _run(tmp_path / "first", None)
    saved = tmp_path / "first" / "checkpoints" / f"ep0-ba{SAVED}-rank0.pt"
    resumed = _run(tmp_path / "resumed", str(saved))
    assert first.batches and SAVED + 1 in resumed.batches  # still in fallback when resumed
    hparams = json.loads((tmp_path / "resumed" / "hparams.json").read_text())  # plain json
    fell = hparams[FALLBACK_PREFIX + LAYER]
    back = hparams[REPROMOTION_PREFIX + LAYER]
    assert fell["step"] == min(first.batches) - 1 < SAVED < back["step"] < BATCHES
    _, _, guard, _, _ = make_report(tmp_path / "resumed" / "metrics.jsonl",
                                    out=tmp_path / "report")
    assert guard is not None
    [fallback] = [f for f in guard.fallbacks if f.layer == LAYER]
    assert (fallback.step, list(fallback.reasons), list(fallback.flagged)) == (
        fell["step"], fell["reasons"], fell["flagged"])  # was SAVED, "no record ..."
    [repromotion] = [r for r in guard.repromotions if r.layer == LAYER]
    assert (repromotion.step, repromotion.fallen_at, repromotion.numbers) == (
        back["step"], back["fallen_at"], back["numbers"])  # was (.., SAVED, {})
    assert (LAYER, fell["step"], back["step"]) in guard.spans()  # was (LAYER, SAVED, ...)
