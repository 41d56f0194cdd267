"""A plain PyTorch loop on a transformers model that turns gradient checkpointing on after
`convert_to_fp8`, the order a user meets when the script enables it where it builds the
optimizer, or calls `gradient_checkpointing_enable()` from a helper after conversion.

`convert_to_fp8` swaps transformers' `_gradient_checkpointing_func` for `fp8_checkpoint` only
where the flag is already on (swap.py `_torch_checkpointed`). Turned on later, transformers'
default (reentrant torch checkpoint, modeling_utils.py `gradient_checkpointing_enable`, 4.51)
recomputes each decoder layer in the backward, outside `fp8_autocast`: the backward runs
through a high-precision recompute and the emulated layers' backward scales stay at their
initial 1.0 for the whole run, silently; non-reentrant fails with torch's "A different number
of tensors was saved" and no word of FP8.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from foundry_fp8 import FP8Recipe, SwapConfig, convert_to_fp8, fp8_autocast

transformers = pytest.importorskip("transformers")

#: What a fix may name: the checkpoint to use, or the call order that makes convert_to_fp8 swap it.
ADVICE = ("fp8_checkpoint", "gradient_checkpointing")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _step(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step's weight gradient of the first MLP and its backward scales."""
    model.train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with fp8_autocast(recipe=FP8Recipe()):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    layer = model.model.layers[0].mlp.up_proj
    return layer.weight.grad.clone(), layer.fp8_meta["scaling_bwd"].scale.clone()


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_turned_on_after_conversion_is_fp8_or_refused(reentrant):
    reference = _llama()
    convert_to_fp8(reference, SwapConfig(backend="emulate"))
    grad, bwd_scale = _step(reference)
    assert bwd_scale[0].item() != 1.0  # the uncheckpointed run's dY scale moved off its start

    model = _llama()
    convert_to_fp8(model, SwapConfig(backend="emulate"))
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    error: Exception | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got, got_scale = _step(model)
        except (RuntimeError, ValueError) as raised:  # torch's CheckpointError is one
            error = raised
    said = [str(w.message) for w in caught] + ([str(error)] if error is not None else [])
    if any(word in text for text in said for word in ADVICE):
        return  # refused or warned, naming the remedy
    assert error is None, str(error)
    torch.testing.assert_close(got, grad, rtol=0, atol=0)
    torch.testing.assert_close(got_scale, bwd_scale, rtol=0, atol=0)
