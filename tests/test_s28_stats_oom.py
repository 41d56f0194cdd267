"""fp8_stats under `device_train_microbatch_size: auto` (LLM-Foundry's usual setting) when the
out-of-memory error is raised inside fp8_stats' own statistics: Composer must see it, halve the
micro-batch and run the batch again, as for an out-of-memory error of the model's own. Before,
the hook kept the error (a failing hook never breaks the forward), the batch went on at the size
that did not fit, and fp8_stats switched itself off for the whole run at that step's end
("fp8_stats failed; disabling it"): step 0, where auto micro-batching searches for its size,
logs in every run.

Composer's auto micro-batching is GPU only; its check is patched to let the CPU run it, as in
`tests/test_stats_microbatches.py`. The statistics of a tensor of more than `FITS` samples raise
CUDA's out-of-memory error (what `torch.cuda.OutOfMemoryError` says on a GPU). Reference: the
batches' own inputs, the first layer's activation."""

from __future__ import annotations

import pytest
import torch
from composer import Trainer
from composer.loggers import InMemoryLogger
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8 import monitor
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.health import layer_key

BATCH, FITS, FEATURES, BATCHES = 8, 2, 16, 3


def _fit(microbatch: int | str, monkeypatch, tensors: tuple[str, ...] = ("activation", "weight",
                                                                        "gradient"),
         ) -> tuple[InMemoryLogger, Trainer, torch.Tensor]:
    real = monitor.sufficient_stats

    def short_of_memory(value: torch.Tensor, *args, **kwargs):
        if not isinstance(value, nn.Parameter) and value.shape[0] > FITS:  # not a weight
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 208.00 MiB")
        return real(value, *args, **kwargs)

    monkeypatch.setattr(monitor, "sufficient_stats", short_of_memory)
    monkeypatch.setattr("composer.trainer.trainer._is_auto_microbatching",
                        lambda size, device: size == "auto")
    torch.manual_seed(0)
    x = torch.randn(BATCHES * BATCH, FEATURES)
    data = TensorDataset(x, torch.randint(0, 2, (BATCHES * BATCH,)))
    net = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 2))
    memory = InMemoryLogger()
    trainer = Trainer(model=ComposerClassifier(net, num_classes=2),
                      train_dataloader=DataLoader(data, batch_size=BATCH),
                      max_duration=f"{BATCHES}ba", device_train_microbatch_size=microbatch,
                      device="cpu", progress_bar=False,
                      optimizers=torch.optim.SGD(net.parameters(), lr=0.0),
                      callbacks=[FP8Stats(interval=1, image_interval=None, tensors=list(tensors))],
                      loggers=[memory])
    trainer.fit()
    return memory, trainer, x


@pytest.mark.filterwarnings("ignore:.*microbatch.*")  # Composer's own warnings about auto
def test_an_out_of_memory_error_in_the_statistics_halves_the_micro_batch_and_they_go_on(
        monkeypatch):
    memory, trainer, x = _fit("auto", monkeypatch)
    assert trainer.state.device_train_microbatch_size == FITS  # 8 -> 4 -> 2
    [stats] = [c for c in trainer.state.callbacks if isinstance(c, FP8Stats)]
    assert not stats.disabled
    amax = {int(t.batch): v
            for t, v in memory.data[layer_key("amax", "activation", "module.0")]}
    # every batch logged, pooled over its 4 micro-batches: the whole batch's largest input
    assert amax == pytest.approx({b: x[b * BATCH:(b + 1) * BATCH].abs().max().item()
                                  for b in range(BATCHES)}, rel=1e-6)
    steps = [int(t.batch) for t, _ in memory.data[layer_key("amax", "gradient", "module.2")]]
    assert steps == list(range(BATCHES))


@pytest.mark.filterwarnings("ignore:.*microbatch.*")
def test_one_raised_in_a_backward_hook_reaches_composer_too(monkeypatch):
    """Gradients only: the error comes out of `loss.backward()` (autograd keeps its type)."""
    memory, trainer, _ = _fit("auto", monkeypatch, tensors=("gradient",))
    assert trainer.state.device_train_microbatch_size == FITS
    steps = [int(t.batch) for t, _ in memory.data[layer_key("amax", "gradient", "module.0")]]
    assert steps == list(range(BATCHES))


def test_without_auto_micro_batching_the_error_stays_ours_and_training_goes_on(monkeypatch,
                                                                               caplog):
    """A fixed micro-batch size: no retry would help, so the run is not stopped by our
    statistics' memory; fp8_stats switches off, said once, as before."""
    memory, trainer, _ = _fit(BATCH, monkeypatch)
    [stats] = [c for c in trainer.state.callbacks if isinstance(c, FP8Stats)]
    assert stats.disabled and int(trainer.state.timestamp.batch) == BATCHES
    assert not any(key.startswith("fp8") for key in memory.data)
    assert "fp8_stats failed; disabling it" in caplog.text
