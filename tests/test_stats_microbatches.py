"""fp8_stats under gradient accumulation, in Composer's own Trainer: a logging step's statistics
are those of every micro-batch of the batch (as of every rank's), not of its first one only.

Reference: the watched layers' inputs and output gradients captured by hooks of the test's own,
one list entry per micro-batch, reduced with plain torch (max of |x|, counts of NaN)."""

from __future__ import annotations

import pytest
import torch
from composer import Trainer
from composer.core import Callback
from composer.loggers import InMemoryLogger
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.health import layer_key

BATCH, MICROBATCH, FEATURES = 8, 2, 16
NAN_STEP, NAN_SAMPLE = 2, BATCH - 1  # in the batch's last micro-batch


class _Captured(Callback):
    """Per batch, the |max| of layer 0's input and of layer 1's output gradient, and the NaNs of
    layer 0's input, one entry per micro-batch (the optimizer's forward only: grad enabled)."""

    def __init__(self) -> None:
        self.by_batch: dict[int, dict[str, list[float]]] = {}
        self._now: dict[str, list[float]] = {}

    def fit_start(self, state, logger) -> None:
        layers = state.model.module

        def forward(module, args) -> None:
            if torch.is_grad_enabled():
                x = args[0].detach()
                self._now.setdefault("x_amax", []).append(x.nan_to_num(0.0).abs().max().item())
                self._now.setdefault("x_nan", []).append(float(x.isnan().sum()))

        def backward(module, grad_output) -> None:
            self._now.setdefault("dy_amax", []).append(grad_output[0].abs().max().item())

        layers[0].register_forward_pre_hook(forward)
        layers[2].register_full_backward_pre_hook(backward)

    def before_train_batch(self, state, logger) -> None:  # again after an OOM retry
        self._now = {}
        self.by_batch[int(state.timestamp.batch)] = self._now


class _OutOfMemoryOnce(Callback):
    """CUDA's out-of-memory error after the first forward of batch NAN_STEP, as
    `device_train_microbatch_size: auto` catches it: Composer halves the micro-batch and runs
    the batch again."""

    def __init__(self) -> None:
        self.raised = False

    def after_forward(self, state, logger) -> None:
        if int(state.timestamp.batch) == NAN_STEP and not self.raised:
            self.raised = True
            raise RuntimeError("CUDA out of memory. Tried to allocate (test)")


@pytest.mark.parametrize("microbatch", [MICROBATCH, BATCH, "auto"])
def test_a_logging_steps_statistics_cover_every_micro_batch(microbatch, monkeypatch):
    """`auto`: Composer's out-of-memory retry (GPU only; its check is patched to let the CPU
    run it) runs the batch again in 2 micro-batches: the failed attempt is not counted."""
    callbacks: list[Callback] = []
    if microbatch == "auto":
        monkeypatch.setattr("composer.trainer.trainer._is_auto_microbatching",
                            lambda size, device: size == "auto")
        callbacks.append(_OutOfMemoryOnce())
    torch.manual_seed(0)
    x = torch.randn(4 * BATCH, FEATURES)
    x[::BATCH] *= 0.1  # each batch's first micro-batch smaller than the rest
    x[NAN_STEP * BATCH + NAN_SAMPLE, :3] = float("nan")
    data = TensorDataset(x, torch.randint(0, 2, (4 * BATCH,)))
    net = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 2))
    captured, memory = _Captured(), InMemoryLogger()
    Trainer(model=ComposerClassifier(net, num_classes=2),
            train_dataloader=DataLoader(data, batch_size=BATCH), max_duration="3ba",
            device_train_microbatch_size=microbatch, device="cpu", progress_bar=False,
            optimizers=torch.optim.SGD(net.parameters(), lr=0.0),  # NaN grads change nothing
            callbacks=[FP8Stats(interval=1, image_interval=None), captured, *callbacks],
            loggers=[memory]).fit()

    def logged(stat: str, tensor: str, layer: str) -> dict[int, float]:
        return {int(t.batch): v for t, v in memory.data[layer_key(stat, tensor, layer)]}

    sizes = {0: BATCH, 1: BATCH, 2: BATCH // 2} if microbatch == "auto" else {
        b: microbatch for b in range(3)}
    assert {b: len(c["x_amax"]) for b, c in captured.by_batch.items()} == {
        b: BATCH // size for b, size in sizes.items()}
    x_amax = {b: max(c["x_amax"]) for b, c in captured.by_batch.items()}
    dy_amax = {b: max(c["dy_amax"]) for b, c in captured.by_batch.items()
               if all(v == v for v in c["dy_amax"])}  # NaN-free gradients
    assert logged("amax", "activation", "module.0") == pytest.approx(x_amax, rel=1e-6)
    assert {b: v for b, v in logged("amax", "gradient", "module.2").items() if b in dy_amax} == \
        pytest.approx(dy_amax, rel=1e-6)
    # every NaN of the step, counted: the 3 of one sample of the last micro-batch
    assert logged("nan_count", "activation", "module.0") == {
        b: sum(c["x_nan"]) for b, c in captured.by_batch.items()} == {0: 0, 1: 0, 2: 3}


def test_a_weights_nonfinite_elements_are_counted_once_per_step_whatever_the_micro_batches():
    """The weight is the same tensor in each of the batch's 4 micro-batches: its one Inf element
    is one, as TE's debug API takes a weight's statistics from its first micro-batch
    (transformer_engine/debug/features/utils/__init__.py, `get_reduction_params`); the
    activation's counts still add up over the micro-batches."""
    torch.manual_seed(0)
    x = torch.randn(2 * BATCH, FEATURES)
    x[BATCH - 1, 0] = float("nan")  # in the first batch's last micro-batch
    data = TensorDataset(x, torch.randint(0, 2, (2 * BATCH,)))
    net = nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        net[2].weight[0, 0] = float("inf")
    weight = net[2].weight.detach().clone()  # the optimizer's NaN step changes it after
    memory = InMemoryLogger()
    Trainer(model=ComposerClassifier(net, num_classes=2),
            train_dataloader=DataLoader(data, batch_size=BATCH), max_duration="1ba",
            device_train_microbatch_size=MICROBATCH, device="cpu", progress_bar=False,
            optimizers=torch.optim.SGD(net.parameters(), lr=0.0),
            callbacks=[FP8Stats(interval=1, image_interval=None)], loggers=[memory]).fit()

    def logged(stat: str, tensor: str, layer: str) -> float:
        return memory.data[layer_key(stat, tensor, layer)][-1][1]

    assert logged("inf_count", "weight", "module.2") == torch.isinf(weight).sum() == 1
    assert logged("nan_count", "weight", "module.0") == 0
    assert logged("nan_count", "activation", "module.0") == torch.isnan(x[:BATCH]).sum() == 1
    assert logged("amax", "weight", "module.2") == weight.abs()[weight.isfinite()].max().item()
