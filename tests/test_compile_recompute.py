"""te_swap's emulated layers under torch.compile (LLM-Foundry's `compile_config`) with
transformers' gradient checkpointing: `fp8_checkpoint`, which te_swap hands such a model, runs
eagerly. Before, Dynamo traced it into its checkpoint operator, which refuses a `context_fn`
function, and the first batch died (`InternalTorchDynamoError: ... checkpoint not implemented
for ... context_fn`). Compiled training is now bit for bit the eager run's, FP8 state
included."""

from __future__ import annotations

import functools

import torch
import torch._dynamo
from torch import nn

from foundry_fp8.emulate import fp8_autocast
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.options import SwapConfig
from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.swap import convert_to_fp8

RECIPE = FP8Recipe(amax_history_len=2)  # 3 steps roll every row: one update more or less shows
STEPS, D = 3, 16


class Checkpointed(nn.Module):
    """Two blocks checkpointed as transformers' `gradient_checkpointing_enable` makes a decoder
    do (modeling_llama.py: `self._gradient_checkpointing_func(decoder_layer.__call__, ...)`,
    the function torch's non-reentrant checkpoint)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)) for _ in range(2))
        self.gradient_checkpointing = True
        self._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                              use_reentrant=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = h + self._gradient_checkpointing_func(block.__call__, h)
        return h


def _train(compiled: bool) -> tuple[list[float], dict[str, dict[str, torch.Tensor]]]:
    """Every step's loss and the FP8 state at the end, after te_swap's `convert_to_fp8`."""
    torch.manual_seed(0)
    model = Checkpointed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    plan = convert_to_fp8(model, SwapConfig(backend="emulate"), optimizers=optimizer,
                          precision="fp32")
    assert plan.recompute == ("",)  # the blocks recompute with fp8_checkpoint
    torch._dynamo.reset()
    # Dynamo alone ("eager" backend): the failure was in tracing; no kernel needs building
    forward = torch.compile(model, backend="eager") if compiled else model
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(STEPS):
        x = torch.randn(16, D, generator=generator) * (step + 1)
        with fp8_autocast(recipe=RECIPE):
            loss = forward(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: read_fp8_meta(m) for n, m in model.named_modules() if read_fp8_meta(m)}


def test_checkpointed_emulated_layers_train_under_torch_compile_as_in_eager():
    eager_losses, eager_state = _train(compiled=False)
    losses, state = _train(compiled=True)
    assert losses == eager_losses
    assert len(state) == 4 and state.keys() == eager_state.keys()
    for name, fields in eager_state.items():
        for key, value in fields.items():
            assert torch.equal(state[name][key], value), (name, key)
    # the backward scales moved from 1: the recompute's backward ran in FP8 and updated them
    assert any(bool((fields["bwd_scale"] != 1).any()) for fields in state.values())
