"""fp8_guard under `compile_config: {}` (LLM-Foundry passes it to Composer, which compiles the
model's forward with torch.compile): a layer that falls back mid-run runs in high precision from
then on. Before, Dynamo traced the guard's new forward pre-hook at the next batch and the run
died (`InternalTorchDynamoError: ... Returning a @contextmanager object from a torch.compile
function`); the hooks now run eagerly, as fp8_stats' do."""

from __future__ import annotations

import torch
from composer import Trainer
from composer.core import Callback, State
from composer.loggers import Logger
from composer.models import ComposerClassifier
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.fp8_meta import read_fp8_meta
from tests.test_guard_flops import FAULTY, INTERVAL, TOKENS, VOCAB, TiedLM

BATCHES = 10


class HistoryRows(Callback):
    """After each batch, how many rows of the faulty layer's forward amax history hold an
    amax: one more per batch the layer ran in FP8 (delayed scaling records each cast)."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def batch_end(self, state: State, logger: Logger) -> None:
        history = read_fp8_meta(state.model.module.blocks[0])["fwd_amax_history"]
        self.rows.append(int((history.abs().sum(dim=1) > 0).sum()))


def test_a_fallback_under_torch_compile_runs_the_layer_in_high_precision():
    torch.manual_seed(0)  # one batch repeated, as test_guard_flops._fit
    tokens, labels = torch.randint(0, VOCAB, (2, TOKENS))
    data = TensorDataset(tokens.repeat(BATCHES), labels.repeat(BATCHES))
    model = ComposerClassifier(TiedLM(), num_classes=VOCAB)
    guard, rows = FP8Guard(consecutive=2, max_fallback_share=0.5), HistoryRows()
    trainer = Trainer(
        model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0), seed=17,
        train_dataloader=DataLoader(data, batch_size=TOKENS), max_duration=f"{BATCHES}ba",
        algorithms=[TESwap(backend="emulate")],
        callbacks=[FP8Stats(interval=INTERVAL, image_interval=None), guard, rows],
        device="cpu", progress_bar=False, compile_config={})
    trainer.fit()
    trainer.close()
    fallen = guard.core.fallbacks[FAULTY].step
    assert fallen == 2 * INTERVAL  # as without compile (tests/test_guard_flops.py)
    # in FP8 for batches 0..fallen (one history row each), then never again
    assert rows.rows == [min(b + 1, fallen + 1) for b in range(BATCHES)]
