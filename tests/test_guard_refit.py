"""A second `Trainer.fit()` in the same process (more batches, or `reset_time=True`) keeps
fp8_guard's fallbacks, as a resume does: the layer stays in high precision, the series keep
counting it and its record keeps the step that decided it (tests/test_guard_flops.py's model:
its faulty block falls back at step 4 and stays faulty)."""

from __future__ import annotations

import logging

import pytest
from composer.loggers import LoggerDestination

from foundry_fp8.composer.guard import FALLBACK_LAYERS
from tests.test_guard_flops import BATCHES, FAULTY, INTERVAL, _fit


class _Hyperparameters(LoggerDestination):
    """Every hyperparameter batch as sent, in order (a sink that keeps only the last value of a
    key, as hparams.json does, cannot tell a key sent twice)."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def log_hyperparameters(self, hyperparameters: dict) -> None:
        self.sent += list(hyperparameters)


@pytest.mark.parametrize("refit", [{"duration": "6ba"}, {"duration": "6ba", "reset_time": True}],
                         ids=["more_batches", "reset_time"])
def test_a_second_fit_keeps_the_fallbacks_of_the_first(tmp_path, caplog, refit):
    sent = _Hyperparameters()
    guard, series, hparams = _fit(tmp_path, 0.5, caplog, refit=refit, loggers=[sent])
    # sent once to this Trainer's loggers: MLflow's asynchronous queue refuses a batch naming a
    # key twice, and a second fit() within its buffer (10 s) lost every param and loss queued
    assert sent.sent.count(f"fp8/guard/fallback/{FAULTY}") == 1
    second = range(0, 6, INTERVAL) if "reset_time" in refit else range(BATCHES, BATCHES + 6,
                                                                        INTERVAL)
    assert {step: series[step][FALLBACK_LAYERS] for step in second} == dict.fromkeys(second, 1.0)
    assert hparams[f"fp8/guard/fallback/{FAULTY}"]["step"] == 2 * INTERVAL
    assert [k for k in hparams if k.startswith("fp8/guard/fallback/")] == [
        f"fp8/guard/fallback/{FAULTY}"]
    assert f"fp8_guard: a new fit() keeps {FAULTY} in high precision" in [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert list(guard.core.fallbacks) == [FAULTY]



def test_a_closed_trainers_fallbacks_do_not_follow_the_model_into_a_new_trainer():
    """A notebook trains its model in a second Trainer (another stage) after closing the first:
    the first Trainer's fp8_guard kept its high-precision hooks on the model, so the faulty
    block ran in high precision in the new Trainer too, where no guard knew it (fp8_stats' table
    said `what-if` for a layer nothing had moved). Its close now takes them off: the new run's
    table says `FP8` for that layer, as for the other te_swap layer."""
    import torch
    from composer import Trainer
    from composer.loggers import LoggerDestination
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.guard import FP8Guard
    from foundry_fp8.composer.stats import FP8_NUMBERS, TABLE_NAME, FP8Stats
    from foundry_fp8.composer.te_swap import TESwap
    from tests.test_guard_flops import TOKENS, VOCAB, TiedLM

    class Tables(LoggerDestination):
        def __init__(self) -> None:
            self.tables: list[tuple[list[str], list[list]]] = []

        def log_table(self, columns, rows, name=TABLE_NAME, step=None) -> None:
            self.tables.append((columns, rows))

    torch.manual_seed(0)  # one batch repeated, as test_guard_flops._fit
    tokens, labels = torch.randint(0, VOCAB, (2, TOKENS))
    data = TensorDataset(tokens.repeat(BATCHES), labels.repeat(BATCHES))
    model = ComposerClassifier(TiedLM(), num_classes=VOCAB)

    def trainer(callbacks: list, algorithms: list, loggers: list) -> Trainer:
        return Trainer(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0),
                       seed=17, train_dataloader=DataLoader(data, batch_size=TOKENS),
                       max_duration=f"{BATCHES}ba", algorithms=algorithms, callbacks=callbacks,
                       loggers=loggers, device="cpu", progress_bar=False)

    guard = FP8Guard(consecutive=2, max_fallback_share=0.5)
    first = trainer([FP8Stats(interval=INTERVAL, image_interval=None), guard],
                    [TESwap(backend="emulate")], [])
    first.fit()
    first.close()
    assert list(guard.core.fallbacks) == [FAULTY]
    tables = Tables()
    # te_swap again: its hooks, which run the emulated layers in FP8, leave with the closed
    # Trainer too (a2e85d1); the layers converted before are kept ("already in FP8")
    second = trainer([FP8Stats(interval=INTERVAL, image_interval=1)], [TESwap(backend="emulate")],
                     [tables])
    second.fit(duration="1ba")
    second.close()
    [(columns, rows)] = tables.tables
    numbers = {row[1]: row[columns.index("numbers")] for row in rows}
    assert (numbers[FAULTY], numbers["module.blocks.1"]) == (FP8_NUMBERS, FP8_NUMBERS)
