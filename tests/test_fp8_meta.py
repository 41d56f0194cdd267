"""fp8_meta: reading and writing delayed-scaling state by TE's attribute layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.fp8_meta import fp8_modules, is_fp8_module, read_fp8_meta, write_fp8_meta
from foundry_fp8.recipe import FP8Recipe


def _trained(history_len: int = 4) -> EmulatedFP8Linear:
    torch.manual_seed(0)
    layer = EmulatedFP8Linear(8, 8)
    for scale in (1.0, 3.0):
        with fp8_autocast(recipe=FP8Recipe(amax_history_len=history_len)):
            out = layer(torch.randn(2, 8) * scale)
        out.sum().backward()
    return layer


def test_detection_and_names():
    model = nn.Sequential(nn.Linear(8, 8), EmulatedFP8Linear(8, 8), nn.LayerNorm(8))
    assert [is_fp8_module(m) for m in model] == [False, True, False]
    assert [name for name, _ in fp8_modules(model)] == ["1"]


def test_read_returns_copies_of_te_layout():
    layer = _trained()
    tensors = read_fp8_meta(layer)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        "fwd_scale": (3,), "fwd_amax_history": (4, 3), "bwd_scale": (2,),
        "bwd_amax_history": (4, 2)}
    assert torch.equal(tensors["fwd_scale"], layer.fp8_meta["scaling_fwd"].scale)
    tensors["fwd_scale"].zero_()
    assert layer.fp8_meta["scaling_fwd"].scale.ne(0).all()
    assert read_fp8_meta(nn.Linear(2, 2)) == {}


def test_write_round_trip_into_fresh_module_takes_history_length():
    source, target = _trained(), EmulatedFP8Linear(8, 8)
    target.load_state_dict(source.state_dict())  # weights only: FP8 state is not in it
    assert target.fp8_meta["scaling_fwd"].amax_history.shape == (0, 3)  # sized by first forward
    write_fp8_meta(target, read_fp8_meta(source))
    for key, value in read_fp8_meta(source).items():
        assert torch.equal(read_fp8_meta(target)[key], value), key
    # the restored history is the one the next forward uses (same recipe length: kept)
    x = torch.randn(2, 8)
    outs = []
    for layer in (source, target):
        with fp8_autocast(recipe=FP8Recipe(amax_history_len=4)):
            outs.append(layer(x))
    assert torch.equal(outs[0], outs[1])


def test_write_refuses_other_history_length_and_writes_nothing():
    source, target = _trained(history_len=4), _trained(history_len=6)
    before = read_fp8_meta(target)
    with pytest.raises(ValueError, match=r"fwd_amax_history has shape \(4, 3\) in the checkpoint, "
                                         r"\(6, 3\) in the model"):
        write_fp8_meta(target, read_fp8_meta(source))
    for key, value in before.items():
        assert torch.equal(read_fp8_meta(target)[key], value), key


def test_write_keeps_te1_scale_inv_consistent():
    """TE 1.x's FP8TensorMeta also holds `scale_inv`, which TE's own update sets to 1 / scale."""
    from types import SimpleNamespace

    module = nn.Module()
    module.fp8_meta = {"scaling_fwd": SimpleNamespace(scale=torch.ones(3), scale_inv=torch.ones(3),
                                                      amax_history=torch.zeros(2, 3))}
    scale = torch.tensor([2.0, 4.0, 8.0])
    write_fp8_meta(module, {"fwd_scale": scale, "fwd_amax_history": torch.ones(2, 3)})
    assert torch.equal(module.fp8_meta["scaling_fwd"].scale_inv, torch.tensor([0.5, 0.25, 0.125]))
