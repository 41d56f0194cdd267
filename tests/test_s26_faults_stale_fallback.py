"""An fp8_guard fallback outlived its Trainer when that Trainer was not closed (LLM-Foundry's
`train()` returns it unclosed; a fit that raised is closed by no one): a new Trainer on the same
model ran the layer in high precision while its own guard reported no fallback and counted the
layer's FLOPs as FP8. The new guard's fit start puts the layer back in FP8, with a fresh
delayed-scaling state, says so, and judges it afresh."""

from __future__ import annotations

import logging

import torch
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.guard import FALLBACK_LAYERS, FP8Guard
from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.composer.te_swap import TESwap
from foundry_fp8.health import INITIAL_SCALE, layer_key
from foundry_fp8.jsonl import read_jsonl
from tests.test_guard_flops import FAULTY, INTERVAL, TOKENS, VOCAB, TiedLM


def _guard_hooks(model: torch.nn.Module) -> int:
    return sum(getattr(hook, "__module__", "") == "foundry_fp8.composer.guard"
               for module in model.modules()
               for hooks in (module._forward_pre_hooks, module._forward_hooks)
               for hook in hooks.values())


def test_a_new_trainers_guard_takes_an_unclosed_trainers_fallback_off_the_model(tmp_path,
                                                                                 caplog):
    from composer import Trainer
    from composer.models import ComposerClassifier

    torch.manual_seed(0)
    tokens, labels = torch.randint(0, VOCAB, (2, TOKENS))
    data = DataLoader(TensorDataset(tokens.repeat(6), labels.repeat(6)), batch_size=TOKENS)
    model = ComposerClassifier(TiedLM(), num_classes=VOCAB)

    def trainer(batches: int, folder: str) -> tuple[FP8Guard, Trainer]:
        guard = FP8Guard(consecutive=2, max_fallback_share=0.5)
        return guard, Trainer(
            model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.0),
            train_dataloader=data, max_duration=f"{batches}ba", device="cpu",
            algorithms=[TESwap(backend="emulate")], progress_bar=False,
            callbacks=[FP8Stats(interval=INTERVAL, image_interval=None), guard],
            loggers=[JSONLLogger(path=str(tmp_path / folder / "metrics.jsonl"))])

    first_guard, first = trainer(6, "first")
    first.fit()  # left unclosed, as LLM-Foundry's train() leaves it
    assert list(first_guard.core.fallbacks) == [FAULTY]
    assert _guard_hooks(model) == 2
    guard, second = trainer(1, "second")
    with caplog.at_level(logging.WARNING, logger="foundry_fp8"):
        second.fit()
    assert _guard_hooks(model) == 0
    [said] = [r.getMessage() for r in caplog.records
              if r.name == "foundry_fp8.composer.guard" and "earlier Trainer" in r.getMessage()]
    assert FAULTY in said
    metrics: dict = {}
    for step, record in read_jsonl(tmp_path / "second" / "metrics.jsonl"):
        if step == 0:  # its only logging step
            metrics.update(record)
    assert metrics[FALLBACK_LAYERS] == 0
    # in FP8 again, from a fresh delayed-scaling state: its first cast is at the initial scale
    assert metrics[layer_key(INITIAL_SCALE, "activation", FAULTY)] == 1
    second.close()
    del first
