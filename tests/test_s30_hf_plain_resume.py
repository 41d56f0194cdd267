"""A plain PyTorch loop resuming a converted Hugging Face model (`convert_to_fp8`, no Composer,
so no `fp8_state`): the model's state_dict holds no FP8 state (emulated layers keep it outside;
te_swap leaves TE's `_extra_state` out), so a resume from model and optimizer state alone
restarts every delayed scale at 1 and its history at zero, and the resumed losses differ from
the uninterrupted run's. Saving `fp8_state_dict` with the checkpoint (through a file, read back
with `weights_only=True`) and `load_fp8_state_dict` before the first resumed forward resumes
bit for bit: losses, scales and amax histories."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from foundry_fp8 import (
    FP8Recipe,
    SwapConfig,
    convert_to_fp8,
    fp8_autocast,
    fp8_state_dict,
    load_fp8_state_dict,
)

transformers = pytest.importorskip("transformers")

BATCHES = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i))
           for i in range(5)]
RECIPE = FP8Recipe(amax_history_len=4)  # a window shorter than the run: rolled histories


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
    losses = []
    for ids in batches:
        with fp8_autocast(recipe=RECIPE):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_plain_resume_is_exact_with_fp8_state_dict_and_not_without():
    model, optimizer = _build()
    want = _train(model, optimizer, BATCHES)[2:]
    want_state = fp8_state_dict(model, recipe=RECIPE)
    model, optimizer = _build()
    _train(model, optimizer, BATCHES[:2])
    file = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "fp8": fp8_state_dict(model, recipe=RECIPE)}, file)
    assert not any("fp8" in key or "extra_state" in key for key in model.state_dict())
    resumed, states = {}, {}
    for restore in (False, True):
        file.seek(0)
        saved = torch.load(file, weights_only=True)
        assert len(saved["fp8"]["modules"]) == 14  # 2 layers x (q, k, v, o, gate, up, down)
        model, optimizer = _build()
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
        if restore:
            load_fp8_state_dict(model, saved["fp8"], recipe=RECIPE)
        resumed[restore] = _train(model, optimizer, BATCHES[2:])
        states[restore] = fp8_state_dict(model, recipe=RECIPE)
    assert resumed[True] == want
    for name, tensors in want_state["modules"].items():
        for field, value in tensors.items():
            assert torch.equal(states[True]["modules"][name][field], value), (name, field)
    assert resumed[False][0] != want[0]  # scale 1, empty history: another first step
