"""A fit that raised mid-step and a Trainer left unclosed (LLM-Foundry's `train()` raises without
closing it; in a notebook the traceback keeps it alive) left fp8_stats' hooks armed on the
model: a new Trainer on the same model then computed the dead run's statistics at every forward,
on top of its own. The next fp8_stats' fit start takes them off."""

from __future__ import annotations

import pytest
import torch
from composer.core import Callback
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from tests.test_guard_flops import TOKENS, VOCAB, TiedLM


class _RaiseInForward(Callback):
    """Raises from the model's forward at the first batch (fp8_stats has armed its hooks)."""

    def fit_start(self, state, logger) -> None:
        def hook(module, args):
            raise RuntimeError("user forward bug")

        self.handle = state.model.module.blocks[1].register_forward_pre_hook(hook)


def _ours(model: torch.nn.Module) -> int:
    """The monitor's hooks on `model` (te_swap's autocast hooks are another callback's)."""
    return sum(getattr(hook, "__module__", "") == "foundry_fp8.monitor"
               for module in model.modules()
               for hooks in (module._forward_pre_hooks, module._forward_hooks,
                             module._backward_pre_hooks)
               for hook in hooks.values())


def test_a_new_fit_takes_the_hooks_of_an_unclosed_fit_that_raised_off_the_model():
    from composer import Trainer
    from composer.models import ComposerClassifier

    torch.manual_seed(0)
    tokens, labels = torch.randint(0, VOCAB, (2, TOKENS))
    data = DataLoader(TensorDataset(tokens.repeat(2), labels.repeat(2)), batch_size=TOKENS)
    model = ComposerClassifier(TiedLM(), num_classes=VOCAB)

    def trainer(*callbacks: Callback) -> Trainer:
        return Trainer(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0),
                       train_dataloader=data, max_duration="1ba", device="cpu",
                       algorithms=[TESwap(backend="emulate")], progress_bar=False,
                       callbacks=[FP8Stats(interval=1, image_interval=None), *callbacks])

    raising = _RaiseInForward()
    first = trainer(raising)
    with pytest.raises(RuntimeError, match="user forward bug"):
        first.fit()
    raising.handle.remove()
    assert _ours(model) == 6  # armed: 3 layers, a forward and a backward hook each
    second = trainer()
    second.fit()
    second.close()
    assert _ours(model) == 0
    del first
