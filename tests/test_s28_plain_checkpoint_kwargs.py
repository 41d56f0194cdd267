"""`fp8_checkpoint(block, x, use_reentrant=False)`: the keyword torch asks every caller of
`torch.utils.checkpoint` to pass (it warns without it) and TE's `checkpoint` takes. fp8_checkpoint
passed `use_reentrant=False` to torch itself and the caller's `**kwargs` after it, so the torch
idiom stopped the first step with torch's "got multiple values for keyword argument
'use_reentrant'", which names neither fp8_checkpoint nor the keyword's cause.
"""

from __future__ import annotations

import torch

from foundry_fp8 import EmulatedFP8Linear, FP8Recipe, fp8_autocast, fp8_checkpoint


def _grads(**kwargs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight gradient and backward scales of one checkpointed FP8 step."""
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(64, 64)
    x = torch.randn(16, 64, requires_grad=True)
    with fp8_autocast(recipe=FP8Recipe()):
        y = fp8_checkpoint(layer, x, **kwargs)
    y.pow(2).sum().backward()
    return layer.weight.grad, layer.fp8_meta["scaling_bwd"].scale


def test_use_reentrant_false_is_the_checkpoint_fp8_checkpoint_already_is():
    want_grad, want_scale = _grads()
    grad, scale = _grads(use_reentrant=False)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
