"""fp8_state's line when te_swap's `fuse_ln_mlp` changed between save and resume (QA Q6 s22).
te_swap renames the MLP's weights and optimizer moments to the other layout (composer/plain.py),
but an MPT MLP's FP8 modules differ too: one te.LayerNormMLP at `ffn` (2 GEMMs) fused, its
`ffn.up_proj` and `ffn.down_proj` plain. Under the default `strict` the resume stops, and its
one line named only include/exclude/keep_first_blocks/keep_last_blocks, load_ignore_keys or
another model: none of which the user changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from foundry_fp8.composer.state import FP8StateError
from foundry_fp8.emulate import EmulatedFP8Linear
from tests.test_state_callback import _LazyStateLinear
from tests.test_state_restore import RECIPE, _callback


def _state(gemms: int) -> dict[str, torch.Tensor]:
    """Fresh delayed-scaling state of a module of `gemms` GEMMs (TE's 3 forward, 2 backward
    tensors per GEMM), `RECIPE`'s history length."""
    rows = RECIPE.amax_history_len
    return {"fwd_scale": torch.ones(3 * gemms), "fwd_amax_history": torch.zeros(rows, 3 * gemms),
            "bwd_scale": torch.ones(2 * gemms), "bwd_amax_history": torch.zeros(rows, 2 * gemms)}


def _mpt(fused: bool, blocks: int = 2) -> nn.Module:
    """`blocks.N.ffn`: one TE-like module (fused) or `up_proj` and `down_proj` (plain)."""
    model = nn.Module()
    model.blocks = nn.ModuleList()
    for _ in range(blocks):
        block = nn.Module()
        if fused:
            block.ffn = _LazyStateLinear(RECIPE.amax_history_len)
        else:
            block.ffn = nn.Module()
            block.ffn.up_proj, block.ffn.down_proj = EmulatedFP8Linear(16, 16), EmulatedFP8Linear(16, 16)
        model.blocks.append(block)
    return model


def _saved(fused: bool, blocks: int = 2) -> dict:
    names = ([f"blocks.{i}.ffn" for i in range(blocks)] if fused else
             [f"blocks.{i}.ffn.{p}" for i in range(blocks) for p in ("up_proj", "down_proj")])
    return {"modules": {n: _state(2 if fused else 1) for n in names},
            "recipe": RECIPE.as_config()}


@pytest.mark.parametrize(("saved_fused", "way"), [(True, "2 MLP(s) saved fused, now plain"),
                                                  (False, "2 MLP(s) saved plain, now fused")])
def test_a_fuse_ln_mlp_change_is_named_as_such(saved_fused, way):
    loader = _callback(_mpt(fused=not saved_fused))
    with pytest.raises(FP8StateError) as error:
        loader.load_state_dict(_saved(saved_fused))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        f"fp8_state: the checkpoint's FP8 modules differ from this run's (te_swap's fuse_ln_mlp "
        f"changed: {way} (blocks.0.ffn, blocks.1.ffn), a te.LayerNormMLP's FP8 state does "
        f"not carry over to ffn.up_proj and ffn.down_proj or back; or te_swap's include/")


def test_an_excluded_mlp_is_not_called_a_fuse_ln_mlp_change():
    """Only one of the two plain layers differs (exclude: 'up_proj'): the old line."""
    model = _mpt(fused=False)
    saved = _saved(fused=False)
    del saved["modules"]["blocks.0.ffn.up_proj"]
    with pytest.raises(FP8StateError, match=r"^fp8_state: the checkpoint's FP8 modules differ "
                       r"from this run's \(te_swap's include/exclude/"):
        _callback(model).load_state_dict(saved)
