"""A metric of several numbers (a per-class torchmetrics metric, `average=None`: Composer logs
what `compute()` returns, a tensor, trainer.py `_compute_and_log_metrics`) is written to the
`jsonl` file as a list. Before, its `.item()` raised, the logger took that for a failed write
and wrote nothing more for the rest of the run: the FP8 series of every later step, and so
`foundry-fp8 report`, were gone after one warning, while W&B had them all."""

from __future__ import annotations

import torch
from composer import Trainer
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.health import layer_key
from foundry_fp8.jsonl import read_jsonl

BATCH, BATCHES = 8, 3


class _Kept(MulticlassAccuracy):
    """The per-class accuracy Composer logs, as it computed it (the reference; on the class:
    Composer computes on its own copies of the model's metrics)."""

    computed: list[list[float]] = []

    def __init__(self) -> None:
        super().__init__(num_classes=2, average=None)

    def compute(self) -> torch.Tensor:
        value = super().compute()
        _Kept.computed.append(value.tolist())
        return value


PER_CLASS = f"metrics/train/{_Kept.__name__}"  # Composer's key: the metric's class name


def test_a_per_class_metric_is_a_list_and_every_later_record_is_written(tmp_path):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(BATCHES * BATCH, 8), torch.randint(0, 2, (BATCHES * BATCH,)))
    _Kept.computed.clear()
    model = ComposerClassifier(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), num_classes=2,
                               train_metrics=_Kept())
    jsonl = JSONLLogger(path=str(tmp_path / "metrics.jsonl"))
    Trainer(model=model, train_dataloader=DataLoader(data, batch_size=BATCH),
            max_duration=f"{BATCHES}ba", callbacks=[FP8Stats(interval=1, image_interval=None)],
            loggers=[jsonl], device="cpu", progress_bar=False).fit()

    assert not jsonl.stopped
    records = list(read_jsonl(tmp_path / "metrics.jsonl"))
    logged = [m[PER_CLASS] for _, m in records if PER_CLASS in m]
    # one per batch, as computed (and the last once more, at the step after the last batch)
    assert logged[:BATCHES] == _Kept.computed == logged[:-1] and logged[-1] == logged[-2]
    assert all(isinstance(v, list) and len(v) == 2 for v in logged)
    key = layer_key("amax", "activation", "module.0")
    assert sorted(step for step, m in records if key in m) == list(range(BATCHES))
