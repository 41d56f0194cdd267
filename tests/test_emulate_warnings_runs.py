"""The emulation's warnings are given once per kind per run, not once per process: a second
model or Trainer in one process (a notebook, a sweep, the variants a benchmark runs in turn)
met the same refused shape in silence, its record kept from the first run. Eval after
training, a second `fit` and more steps of the same model stay one run."""

from __future__ import annotations

import warnings

import torch
from composer import Trainer
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe

D = 16


def _kinds(caught: list[warnings.WarningMessage]) -> list[str]:
    return [kind for w in caught for key, kind in (("stops the forward", "forward"),
                                                   ("Caller must pad", "backward"))
            if key in str(w.message)]


def _steps(model: nn.Module) -> None:
    for length in (5, 7):  # TE's forward refuses 5 and 7 tokens
        with fp8_autocast(recipe=FP8Recipe()):
            model(torch.randn(length, 64)).sum().backward()


def test_a_model_built_after_fp8_ran_warns_again_the_same_model_does_not():
    first = EmulatedFP8Linear(64, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(first)
        _steps(first)
        assert _kinds(caught) == ["forward"]
        _steps(EmulatedFP8Linear(64, 32))  # the old once-per-process record: no second line
        assert _kinds(caught) == ["forward", "forward"]
        _steps(first)  # the new run's, as the first model's layers could not be told apart
        assert _kinds(caught) == ["forward", "forward"]


def test_models_built_before_fp8_ran_share_a_run():
    """The documented limit: both built, then both trained, is one run."""
    first, second = EmulatedFP8Linear(64, 32), EmulatedFP8Linear(64, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(first)
        _steps(second)
    assert _kinds(caught) == ["forward"]


def _fit() -> list[str]:
    """A new model's Trainer: te_swap's emulated block trains on batches of 8 tokens (TE's FP8
    backward needs 16) and evaluates after each batch; the kinds it warned of."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, D))
    net.blocks = nn.ModuleList([nn.Linear(D, D)])  # te_swap converts `blocks.<n>` layers
    net.forward = lambda x: net[0](net.blocks[0](x))
    model = ComposerClassifier(net, num_classes=D)
    data = TensorDataset(torch.randn(16, D), torch.randint(0, D, (16,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                          train_dataloader=DataLoader(data, batch_size=8), max_duration="2ba",
                          eval_dataloader=DataLoader(data, batch_size=8), eval_interval="1ba",
                          algorithms=[TESwap(backend="emulate")], device="cpu",
                          progress_bar=False, loggers=[])
        try:
            trainer.fit()
        finally:
            trainer.close()
    assert isinstance(net.blocks[0], EmulatedFP8Linear)
    return _kinds(caught)


def test_each_trainer_in_one_process_warns_once():
    assert _fit() == ["backward"]
    assert _fit() == ["backward"]  # the old once-per-process record: []
