"""A Trainer left unclosed (LLM-Foundry's `train()` returns it so; a fit that raised is never
closed) kept te_swap's recipe-autocast hooks on the model. A second Trainer on the same model
added its own pair, and the four ran enter, enter, exit, exit: the first exit restored the
state from before its own entry under the second's, which then put the enabled autocast back.
FP8 stayed on after the fit, for every later forward in the process (eval, other models): this
is how 9 later tests of the full suite failed after test_s26_faults_unclosed."""

from __future__ import annotations

import logging

import torch
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.emulate import is_fp8_enabled
from tests.test_guard_flops import TOKENS, VOCAB, TiedLM


def _te_swap_hooks(model: torch.nn.Module) -> int:
    return sum(getattr(hook, "__self__", None).__class__ is TESwap
               for hooks in (model._forward_pre_hooks, model._forward_hooks)
               for hook in hooks.values())


def test_a_second_trainer_on_a_model_leaves_no_fp8_autocast_on(caplog):
    from composer import Trainer
    from composer.models import ComposerClassifier

    torch.manual_seed(0)
    tokens, labels = torch.randint(0, VOCAB, (2, TOKENS))
    data = DataLoader(TensorDataset(tokens.repeat(2), labels.repeat(2)), batch_size=TOKENS)
    model = ComposerClassifier(TiedLM(), num_classes=VOCAB)

    def trainer() -> Trainer:
        return Trainer(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0),
                       train_dataloader=data, max_duration="1ba", device="cpu",
                       algorithms=[TESwap(backend="emulate")], progress_bar=False)

    first = trainer()
    first.fit()  # not closed, as LLM-Foundry's train() leaves it
    assert not is_fp8_enabled()
    with caplog.at_level(logging.WARNING, logger="foundry_fp8.composer.te_swap"):
        second = trainer()
    assert "an earlier Trainer on this model was never closed" in caplog.text
    assert _te_swap_hooks(model) == 2  # the second's pair only
    try:
        second.fit()
        assert not is_fp8_enabled()
    finally:
        second.close()
        first.close()
    assert _te_swap_hooks(model) == 0
