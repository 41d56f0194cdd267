"""TE 2.20.2's `_extra_state` contract where a load meets te_swap's TE modules.

te_swap's checkpoints leave TE's `_extra_state` out. torch's `set_model_state_dict` with a full
state dict (Composer's loader under FSDP's default `state_dict_type: full`) hands each TE module
whose key the checkpoint lacks torch's `_EXTRA_STATE()` placeholder, which TE 2.20.2's
`set_extra_state` refuses ("Unsupported checkpoint format.", pytorch/module/base.py:1443), so
every resume of a te_swap run under FSDP would stop at the load (read in TE's and torch 2.11's
sources, not yet seen on a GPU). The stand-in TE (tests/fake_te.py) accepted anything, so the
CPU tests never saw it.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    _EXTRA_STATE,
    StateDictOptions,
    set_model_state_dict,
)

from foundry_fp8.te.extra_state import extra_state_missing, inert_extra_state


def test_torch_s_placeholder_and_an_absent_key_count_as_missing():
    key = "blocks.0._extra_state"
    assert extra_state_missing({}, key)
    assert extra_state_missing({key: _EXTRA_STATE()}, key)
    for value in (inert_extra_state(), torch.empty(0, dtype=torch.uint8), None):
        assert not extra_state_missing({key: value}, key)


def test_the_stand_in_refuses_what_te_2_20_2_refuses(fake_te, monkeypatch):
    """The stand-in's `set_extra_state` as TE 2.20.2's (pytorch/_extra_state.py): a pickled None
    and an empty tensor are no state; a delayed-scaling pickle needs the opt-in variable; torch's
    placeholder is no checkpoint format."""
    fake_te("2.20.2")
    import transformer_engine.pytorch as te

    layer = te.Linear(16, 16, device="cpu")
    assert layer.get_extra_state().numel() == 0  # never ran in FP8 (base.py:1388-1389)
    layer.set_extra_state(inert_extra_state())
    layer.set_extra_state(torch.empty(0, dtype=torch.uint8))
    delayed = torch.frombuffer(bytearray(pickle.dumps(
        {"recipe": None, "scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(4, 3)})),
        dtype=torch.uint8)
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    with pytest.raises(RuntimeError, match="NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"):
        layer.set_extra_state(delayed)
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    layer.set_extra_state(delayed)
    with pytest.raises(RuntimeError, match="Unsupported checkpoint format"):
        layer.set_extra_state(_EXTRA_STATE())


def test_a_te_swap_checkpoint_loads_through_torch_s_full_state_dict_loader(fake_te):
    """A te_swap model's own state dict (no `_extra_state`) back through `set_model_state_dict`
    with a full state dict, strict, as Composer loads under FSDP: the weights arrive and TE's
    modules get the inert state instead of torch's placeholder."""
    fake_te("2.20.2")
    from foundry_fp8.swap import SwapConfig, apply_swap, plan_swap

    def model() -> nn.Module:
        net = nn.Module()
        net.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        apply_swap(net, plan_swap(net, SwapConfig(backend="te")))
        assert all(type(m).__module__.startswith("transformer_engine") for m in net.blocks)
        return net

    torch.manual_seed(0)
    saved = model().state_dict()
    assert saved and not any(k.endswith("_extra_state") for k in saved)
    torch.manual_seed(1)
    loaded = model()
    set_model_state_dict(loaded, dict(saved), options=StateDictOptions(full_state_dict=True,
                                                                 strict=True))
    for name, value in saved.items():
        assert torch.equal(loaded.state_dict()[name], value), name
