"""fp8_guard with `repromote_after` in a real Composer run whose layers fall back and come back
over and over (an outlier injected 2 batches of every 6). Loggers keep every hyperparameter key
ever given (hparams.json, W&B's config: a column each in its runs table), and each
fallback/re-promotion pair added ~3.4 kB of new keys there for the whole run. Now a layer's
first `KEPT_DECISIONS` pairs are logged whole and its summaries at 1, 2, 4, ... pairs, while the
report still shows every span, from the series `fp8/guard/in_fallback/<layer>`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from composer import Callback, Trainer
from composer.loggers import WandBLogger
from composer.models import ComposerClassifier
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8 import wandb_history
from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.fault import InjectOutlier
from foundry_fp8.guard import FALLBACK_LAYERS, KEPT_DECISIONS
from foundry_fp8.report.cli import make_report
from tests.test_state_restore import TwoBlocks

PAIRS, PERIOD, FIRST = 12, 6, 4  # the fault at batches FIRST + PERIOD * i, 2 batches long
BATCHES = FIRST + PERIOD * PAIRS + 2
LAYERS = ("module.blocks.0", "module.blocks.1")  # the outlier's gradient flags blocks.0 too


class HighPrecision(Callback):
    """The layers that run in high precision at each batch: those the guard hooked."""

    def __init__(self, guard: FP8Guard):
        self.guard, self.batches = guard, {layer: set() for layer in LAYERS}

    def batch_start(self, state, logger) -> None:
        for layer in self.guard._handles:
            self.batches[layer].add(int(state.timestamp.batch))


@pytest.fixture(scope="module")
def flapping(tmp_path_factory) -> tuple[Path, HighPrecision]:
    folder = tmp_path_factory.mktemp("flapping")
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 16).repeat(BATCHES, 1),
                         torch.randint(0, 16, (8,)).repeat(BATCHES))
    model = ComposerClassifier(TwoBlocks(), num_classes=16)
    guard = FP8Guard(consecutive=1, repromote_after=1, max_fallback_share=1.0)
    seen = HighPrecision(guard)
    faults = [InjectOutlier(LAYERS[1], start=FIRST + PERIOD * i, stop=FIRST + 2 + PERIOD * i)
              for i in range(PAIRS)]
    trainer = Trainer(
        model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0), seed=17,
        run_name="flapping", train_dataloader=DataLoader(data, batch_size=8),
        max_duration=f"{BATCHES}ba", algorithms=[TESwap(backend="emulate")],
        callbacks=[FP8Stats(interval=1, image_interval=None), guard, seen, *faults],
        loggers=[JSONLLogger(path=str(folder / "metrics.jsonl")),
                 WandBLogger(project="flapping", init_kwargs={
                     "mode": "offline", "dir": str(folder),
                     "settings": {"allow_offline_artifacts": False}})],
        device="cpu", progress_bar=False)
    trainer.fit()
    trainer.close()
    return folder, seen


def _guard_keys(keys, layer: str) -> list[str]:
    return [k for k in keys if k.startswith("fp8/guard/") and k.split("/", 3)[-1] in (
        layer, *(f"{layer}.ba{s}" for s in range(BATCHES)))]


def test_a_flapping_layer_logs_a_number_of_keys_logarithmic_in_its_pairs(flapping):
    folder, seen = flapping
    hparams = json.loads((folder / "hparams.json").read_text())  # plain json
    [run] = wandb_history.read_runs(folder, wait=120)  # W&B's own reader
    # the fault's windows: each layer fell back and came back once per window
    for layer in LAYERS:
        starts = [b for b in sorted(seen.batches[layer]) if b - 1 not in seen.batches[layer]]
        assert len(starts) == PAIRS, layer
    bound = 2 * KEPT_DECISIONS + math.floor(math.log2(PAIRS - KEPT_DECISIONS)) + 1
    for keys in (hparams.keys(), run.config.keys()):
        for layer in LAYERS:
            # was 2 * PAIRS records and PAIRS - KEPT_DECISIONS summaries: 32 keys each
            assert KEPT_DECISIONS * 2 < len(_guard_keys(keys, layer)) <= bound, layer


@pytest.mark.parametrize("source", ["metrics.jsonl", "wandb"])
def test_the_report_shows_every_span_of_a_flapping_layer(flapping, source):
    """Each span's steps as the layer ran them (the guard's hooks at each batch), and each
    logging step's count of layers in fallback as metrics.jsonl holds it (plain json)."""
    folder, seen = flapping
    _, _, guard, _, _ = make_report(folder / "metrics.jsonl" if source == "metrics.jsonl"
                                    else folder, out=folder / source.replace(".", "_"))
    assert guard is not None
    spans = guard.spans()
    for layer in LAYERS:
        ran = {step for name, decided, ended in spans if name == layer
               for step in range(decided + 1, (BATCHES if ended is None else ended) + 1)}
        assert ran == seen.batches[layer], layer
    counted: dict[int, float] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if FALLBACK_LAYERS in record["metrics"]:
            counted[record["step"]] = record["metrics"][FALLBACK_LAYERS]
    assert len(counted) == BATCHES
    for step, count in counted.items():
        assert count == sum(decided <= step and (ended is None or step < ended)
                            for _, decided, ended in spans), step
    text = (folder / source.replace(".", "_") / "fp8_report.md").read_text()
    assert f"in {2 * PAIRS} fallbacks" in text
