"""transformers' gradient checkpointing in a te_swap model with `backend: te` (TE #1190).

`gradient_checkpointing_enable()` makes every decoder layer call torch's checkpoint, which
recomputes outside TE's FP8 autocast. te_swap refused such a model, asking the user to call
`model._set_gradient_checkpointing(True, transformer_engine.pytorch.checkpoint)`; it now hands
those modules TE's checkpoint itself, with the user's `gradient_checkpointing_kwargs`. Run
against the TE stand-in (tests/fake_te.py, whose `checkpoint` records its calls and recomputes
with torch's non-reentrant checkpoint): no GPU, no real TE.
"""

from __future__ import annotations

import sys

import pytest
import torch

from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import HF_CHECKPOINT_FUNC, convert_to_fp8
from tests.test_swap_recompute_hf import _llama

STEPS = 2


def _train(checkpointing: dict | None):
    """Each step's loss, the weights at the end and te_swap's plan, backend te."""
    model = _llama(checkpointing)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    plan = convert_to_fp8(model, SwapConfig(backend="te"), optimizers=optimizer)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 128, (4, 32), generator=generator)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()
               if not k.endswith("_extra_state")}
    return model, plan, losses, weights


def _context_fn():
    return torch.utils.checkpoint.noop_context_fn()


@pytest.mark.parametrize(("checkpointing", "te_kwargs"), [
    ({}, {"use_reentrant": True}),  # transformers' default
    ({"use_reentrant": False}, {"use_reentrant": False}),
    # TE always restores the RNG states; the keyword would reach the decoder layer's call
    ({"use_reentrant": False, "preserve_rng_state": False}, {"use_reentrant": False}),
    # TE's checkpoint takes torch's context_fn (emulate refuses it: fp8_checkpoint has its own)
    ({"use_reentrant": False, "context_fn": _context_fn},
     {"use_reentrant": False, "context_fn": _context_fn}),
], ids=["transformers-default", "non-reentrant", "preserve_rng_state", "context_fn"])
def test_te_backend_recomputes_with_te_s_checkpoint(fake_te, checkpointing, te_kwargs):
    pytest.importorskip("transformers")
    fake_te()
    _, _, want_losses, want_weights = _train(None)
    te_checkpoint = sys.modules["transformer_engine.pytorch"].checkpoint
    assert te_checkpoint.calls == []
    model, plan, losses, weights = _train(checkpointing)
    assert plan.recompute == ("model",)  # LlamaModel holds the flag and the function
    function = getattr(model.model, HF_CHECKPOINT_FUNC)
    assert function.func is te_checkpoint and function.args == ()
    # 2 decoder layers a forward; transformers 4.51 passes the layer's 8 inputs positionally
    assert len(te_checkpoint.calls) == 2 * STEPS
    for call in te_checkpoint.calls:
        assert call.te_kwargs == te_kwargs and call.function_kwargs == {}
        assert len(call.args) == 8 and call.args[0].shape == (4, 32, 64)
    # the stand-in's modules compute in high precision: the run is the unchecked one exactly
    assert losses == want_losses
    assert weights.keys() == want_weights.keys()
    assert all(torch.equal(weights[k], v) for k, v in want_weights.items())
