"""`compile_config: {fullgraph: true}` with te_swap: the FP8 layers' forwards run outside
torch.compile (TE's `no_torch_dynamo`, the emulation's `torch.compiler.disable`), so no single
graph can hold the model. te_swap says so in one line naming `compile_config` at FIT_START,
before any batch; before, Dynamo stopped the first batch with its own traceback
(`torch._dynamo.exc.Unsupported: Skip calling torch.compiler.disable()d function`). Without
fullgraph the run compiles and trains."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from composer import Trainer
from composer.core import Callback, State
from composer.loggers import Logger
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.te_swap import TESwap

D = 16


class Batches(Callback):
    def __init__(self) -> None:
        self.count = 0

    def batch_end(self, state: State, logger: Logger) -> None:
        self.count += 1


def _fit(compile_config: dict | None,
         wrap: Callable[[ComposerClassifier], ComposerClassifier] = lambda model: model) -> int:
    """Batches trained by a 2-batch run of one te_swap'd block under `compile_config`, the
    model passed through `wrap`."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, D))
    net.blocks = nn.ModuleList([nn.Linear(D, D)])  # te_swap converts `blocks.<n>` layers
    net.forward = lambda x: net[0](net.blocks[0](x))
    model = wrap(ComposerClassifier(net, num_classes=D))
    data = TensorDataset(torch.randn(32, D), torch.randint(0, D, (32,)))
    batches = Batches()
    trainer = Trainer(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                      train_dataloader=DataLoader(data, batch_size=16), max_duration="2ba",
                      algorithms=[TESwap(backend="emulate")], callbacks=[batches],
                      device="cpu", progress_bar=False, compile_config=compile_config)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return batches.count


def test_fullgraph_is_refused_in_one_line_before_any_batch():
    with pytest.raises(ValueError) as raised:
        _fit({"backend": "eager", "fullgraph": True})
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("te_swap: compile_config fullgraph: true cannot compile")


def test_without_fullgraph_the_compiled_run_trains():
    assert _fit({"backend": "eager"}) == 2


def _with_empty_cell(model: ComposerClassifier) -> ComposerClassifier:
    """`model`, its forward a closure over a name never bound (an empty closure cell)."""
    plain = model.forward

    def forward(batch: tuple) -> torch.Tensor:
        if batch is None:
            return unbound(batch)
        return plain(batch)

    model.forward = forward
    return model
    unbound = None  # bound after the return: the cell stays empty


def test_a_forward_closing_over_an_unbound_name_trains():
    """te_swap's fullgraph check read each closure cell of the forward; an empty one raised
    `ValueError: Cell is empty` at FIT_START, stopping a run that has no compile_config."""
    assert _fit(None, _with_empty_cell) == 2
