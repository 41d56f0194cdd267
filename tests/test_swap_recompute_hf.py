"""transformers' gradient checkpointing in a te_swap model (TE #1190 class).

`gradient_checkpointing_enable()` makes every decoder layer call torch's checkpoint
(reentrant by default, transformers 4.51 modeling_utils.py:3120), which recomputes in the
backward, outside the FP8 autocast. Before, with te_swap's emulated layers: reentrant trained
with high-precision recompute gradients and never updated the backward scales (fp8_state
stopped a Composer run after its watch window), non-reentrant failed at the first backward with
torch's "A different number of tensors was saved". te_swap now hands those layers
`fp8_checkpoint`: training is bit for bit the run without checkpointing, FP8 state included.
"""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.emulate import fp8_autocast
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.options import SwapConfig
from foundry_fp8.recipe import FP8Recipe
from foundry_fp8.swap import convert_to_fp8

RECIPE = FP8Recipe(amax_history_len=4)  # 6 steps roll every row: one update more or less shows
STEPS = 6


def _llama(checkpointing: dict | None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=128, max_position_embeddings=64))
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing or None)
    return model


def _train(checkpointing: dict | None):
    """Every step's loss and the FP8 state and weights at the end."""
    model = _llama(checkpointing)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    plan = convert_to_fp8(model, SwapConfig(backend="emulate"), optimizers=optimizer,
                          precision="fp32")
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 128, (4, 32), generator=generator)
        with fp8_autocast(recipe=RECIPE):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    state = {n: read_fp8_meta(m) for n, m in model.named_modules() if read_fp8_meta(m)}
    return plan, losses, state, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("transformers")
    return _train(None)


@pytest.mark.parametrize("checkpointing", [{}, {"use_reentrant": False}],
                         ids=["transformers-default-reentrant", "non-reentrant"])
def test_checkpointed_training_is_the_unchecked_run_bit_for_bit(reference, checkpointing):
    _, want_losses, want_state, want_weights = reference
    plan, losses, state, weights = _train(checkpointing)
    assert plan.recompute == ("model",)  # LlamaModel holds the flag and the function
    assert losses == want_losses
    assert state.keys() == want_state.keys() and len(state) == 14
    for name, meta in want_state.items():
        for key, value in meta.items():
            assert torch.equal(state[name][key], value), (name, key)
        # the backward scales updated: the past rows (row 0 restarts at each update) hold amaxes
        assert (meta["bwd_amax_history"][1:, 0] > 0).all(), name
    assert all(torch.equal(weights[k], v) for k, v in want_weights.items())


def test_a_user_s_context_fn_is_refused_in_one_line_before_any_change():
    """Review s15: fp8_checkpoint passes its own context_fn to torch's checkpoint, so a user's
    (selective activation checkpointing) crashed the first forward with torch's TypeError
    'got multiple values for keyword argument context_fn'."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    model = _llama({"use_reentrant": False,
                    "context_fn": lambda: create_selective_checkpoint_contexts(policy)})
    with pytest.raises(ValueError, match=r"^te_swap: model checkpoints with a context_fn") as err:
        convert_to_fp8(model, SwapConfig(backend="emulate"), precision="fp32")
    assert "\n" not in str(err.value)
    assert not any(type(m).__name__ == "EmulatedFP8Linear" for m in model.modules())


def test_a_composer_run_with_fp8_state_trains_and_says_so(reference, capsys):
    """The user's path: te_swap and fp8_state in a Composer Trainer. Before, fp8_state's watch
    stopped this run after its window (backward scales not updating, TE #1190 symptom)."""
    from composer import Trainer
    from composer.models import HuggingFaceModel

    from foundry_fp8.composer.state import FP8State
    from foundry_fp8.composer.te_swap import TESwap

    model = _llama({})
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 128, (4, 32), generator=generator)
        batches.append({"input_ids": tokens, "labels": tokens.clone()})
    swap = TESwap(backend="emulate", fp8_recipe={"amax_history_len": 4})
    Trainer(model=HuggingFaceModel(model, use_logits=True), train_dataloader=batches,
            max_duration=f"{STEPS}ba", algorithms=[swap], callbacks=[FP8State()],
            optimizers=torch.optim.SGD(model.parameters(), lr=0.05), device="cpu",
            device_train_microbatch_size=4, progress_bar=False).fit()
    assert "gradient checkpointing in model.model recomputes with" in capsys.readouterr().out
    # the same steps as the reference loop, unchecked: the same FP8 state, bit for bit
    state = {n: read_fp8_meta(m) for n, m in model.named_modules() if read_fp8_meta(m)}
    want_state = reference[2]
    assert state.keys() == want_state.keys()
    for name, meta in want_state.items():
        for key, value in meta.items():
            assert torch.equal(state[name][key], value), (name, key)
