"""A plain PyTorch loop resuming a converted Hugging Face model (`convert_to_fp8`, no Composer,
so no `fp8_state`): the model's state_dict holds no FP8 state (emulated layers keep it outside;
te_swap leaves TE's `_extra_state` out), so a resume from model and optimizer state alone
restarts every delayed scale at 1 and its history at zero, and the resumed losses differ from
the uninterrupted run's. Saving `read_fp8_meta` per FP8 module with the checkpoint and writing
it back with `write_fp8_meta` before the first resumed forward resumes bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch

from foundry_fp8 import FP8Recipe, SwapConfig, convert_to_fp8, fp8_autocast
from foundry_fp8.fp8_meta import fp8_modules, read_fp8_meta, write_fp8_meta

transformers = pytest.importorskip("transformers")

BATCHES = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i))
           for i in range(5)]


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    convert_to_fp8(model, SwapConfig(backend="emulate"), optimizers=optimizer, precision="fp32")
    return model, optimizer


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           batches: list[torch.Tensor]) -> list[float]:
    recipe, losses = FP8Recipe(), []
    for ids in batches:
        with fp8_autocast(recipe=recipe):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_plain_resume_is_exact_with_the_fp8_meta_and_not_without():
    want = _train(*_build(), BATCHES)[2:]
    model, optimizer = _build()
    _train(model, optimizer, BATCHES[:2])
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "fp8": {name: read_fp8_meta(m) for name, m in fp8_modules(model)}})
    assert not any("fp8" in key or "extra_state" in key for key in saved["model"])
    resumed = {}
    for restore in (False, True):
        model, optimizer = _build()
        model.load_state_dict(saved["model"])
        # torch's load_state_dict keeps the given tensors: a copy, or the next resume reads
        # this one's updated moments
        optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
        if restore:
            for name, module in fp8_modules(model):
                write_fp8_meta(module, saved["fp8"][name])
        resumed[restore] = _train(model, optimizer, BATCHES[2:])
    assert resumed[True] == want
    assert resumed[False][0] != want[0]  # scale 1, empty history: another first step
