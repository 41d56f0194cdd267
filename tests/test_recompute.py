"""The TE #1190 class on CPU: activation recompute must not change FP8 numerics.

Two training iterations of a small model of emulated FP8 linears, with and without activation
checkpointing: `fp8_checkpoint` gives bit-identical input gradients and FP8 state; plain
`torch.utils.checkpoint` (the guard off) does not.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast, fp8_checkpoint
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.recipe import FP8Recipe

RECIPE = FP8Recipe(amax_history_len=4)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = EmulatedFP8Linear(dim, 4 * dim)
        self.down = EmulatedFP8Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, dim: int = 16, checkpoint=None):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.checkpoint = checkpoint

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if self.checkpoint is None else self.checkpoint(block, x)
        return x


def _plain(use_reentrant: bool):
    return lambda fn, x: torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=use_reentrant)


def _recompute_in_autocast(fn, x):
    """The naive fix: recompute under fp8_autocast, but with the scales in force at recompute."""
    return torch.utils.checkpoint.checkpoint(
        fn, x, use_reentrant=False, context_fn=lambda: (nullcontext(), fp8_autocast(recipe=RECIPE)))


def _train(checkpoint, iterations: int = 2):
    """Per iteration: input gradient and every module's FP8 state; same data for every variant."""
    torch.manual_seed(0)
    model = Model()
    model.checkpoint = checkpoint
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    results = []
    for step in range(iterations):
        x = (torch.randn(8, 16, generator=generator) * (step + 1)).requires_grad_()
        with fp8_autocast(recipe=RECIPE):
            out = model(x)
        (out * torch.randn(out.shape, generator=generator)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        state = {name: read_fp8_meta(m) for name, m in model.named_modules() if read_fp8_meta(m)}
        results.append((x.grad.clone(), copy.deepcopy(state)))
    return results


@pytest.fixture(scope="module")
def reference():
    return _train(None)


def test_fp8_checkpoint_is_bit_identical_to_no_checkpointing(reference):
    for (grad, state), (want_grad, want_state) in zip(_train(fp8_checkpoint), reference,
                                                      strict=True):
        assert torch.equal(grad, want_grad)
        assert state.keys() == want_state.keys() and len(state) == 4
        for name, tensors in want_state.items():
            for key, value in tensors.items():
                assert torch.equal(state[name][key], value), (name, key)
    # the backward scales really moved away from their initial 1.0 in both iterations
    scales = [s["blocks.0.up"]["bwd_scale"][0].item() for _, s in reference]
    assert scales[0] != 1.0 and scales[1] != scales[0]


@pytest.mark.parametrize("checkpoint", [_plain(True), _recompute_in_autocast],
                         ids=["torch-reentrant", "autocast-in-recompute"])
def test_guard_off_silently_changes_gradients(reference, checkpoint):
    results = _train(checkpoint)
    assert any(not torch.equal(g, want) for (g, _), (want, _) in zip(results, reference,
                                                                       strict=True))


def test_plain_non_reentrant_checkpoint_fails_loudly():
    """Outside FP8 the recompute saves other tensors (plain linear), which torch detects."""
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        _train(_plain(False), iterations=1)


def test_reentrant_checkpoint_freezes_backward_scales(reference):
    """The #1190 symptom: the recompute runs outside FP8, so no backward amax is ever recorded."""
    for _, state in _train(_plain(True)):
        for tensors in state.values():
            assert torch.equal(tensors["bwd_scale"], torch.ones(2))
            assert tensors["bwd_amax_history"].abs().sum() == 0


def test_fp8_checkpoint_outside_autocast_is_plain_checkpoint():
    torch.manual_seed(0)
    model = Model()
    x = torch.randn(4, 16, requires_grad=True)
    model.checkpoint = fp8_checkpoint
    model(x).sum().backward()
    got = x.grad.clone()
    x.grad = None
    model.checkpoint = None
    model(x).sum().backward()
    assert torch.equal(got, x.grad)
    assert all(not read_fp8_meta(m).get("fwd_amax_history", torch.zeros(1)).any()
               for m in model.modules())
