"""`init_device: meta` with `backend: te`: the te.Linear layers te_swap builds on the meta device
are initialised later by LLM-Foundry's param_init_fn, which for an HF model calls TE's own
`reset_parameters` (llmfoundry/models/hf/hf_base.py, `_custom_param_init_fn`, 0.21 and 0.22).
They must get the weights the unswapped model's nn.Linear would have got there."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from llmfoundry.models.hf import hf_base
from llmfoundry.models.hf.hf_base import BaseHuggingFaceModel
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from foundry_fp8.swap import SwapConfig, convert_to_fp8
from tests.fake_te import TE_DEFAULT_INIT_STD

INITIALIZER_RANGE = 0.05  # far from TE's default 0.023, so the two inits cannot be confused


def _meta_llama() -> nn.Module:
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         initializer_range=INITIALIZER_RANGE, tie_word_embeddings=False,
                         attention_bias=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    BaseHuggingFaceModel.prepare_inner_model(model, init_device="meta")  # sets param_init_fn
    return model


def _meta_init(module: nn.Module, param_init_fn: object = None) -> None:
    """Composer's FSDP2 meta init (composer/distributed/param_init.py `meta_init`, 0.32), on
    the CPU instead of CUDA: children first, each module with meta parameters emptied and
    handed to the nearest `param_init_fn`."""
    param_init_fn = getattr(module, "param_init_fn", param_init_fn)
    for child in module.children():
        _meta_init(child, param_init_fn)
    if any(p.is_meta for p in module.parameters(recurse=False)):
        module.to_empty(device="cpu", recurse=False)
        param_init_fn(module)


def test_hf_meta_init_gives_swapped_layers_the_hf_init(fake_te, monkeypatch):
    fake_te("2.20.2")
    te = sys.modules["transformer_engine.pytorch"]
    # as where TE is installed; the stand-in has no te.LayerNormLinear, which te_swap never builds
    monkeypatch.setattr(hf_base, "te", SimpleNamespace(
        Linear=te.Linear, LayerNormMLP=te.LayerNormMLP, LayerNormLinear=type("LNL", (), {})))

    reference = _meta_llama()  # the unswapped model: HF's own _init_weights on nn.Linear
    torch.manual_seed(0)
    _meta_init(reference)

    swapped = _meta_llama()
    plan = convert_to_fp8(swapped, SwapConfig(backend="te", keep_lm_head=True))
    names = [d.name for d in plan.converted]
    assert names and all(isinstance(swapped.get_submodule(n), te.Linear) for n in names)
    torch.manual_seed(0)
    _meta_init(swapped)

    for name in names:
        weight = swapped.get_submodule(name).weight
        assert not weight.is_meta
        assert torch.equal(weight, reference.get_submodule(name).weight), name
        # a bias-free te.Linear keeps an empty plain tensor as `bias` (tests/fake_te.py `_no_bias`)
        bias = dict(swapped.get_submodule(name).named_parameters()).get("bias")
        assert bias is None or torch.equal(bias, reference.get_submodule(name).bias), name
    stds = torch.stack([swapped.get_submodule(n).weight.std() for n in names])
    assert stds.mean().item() == pytest.approx(INITIALIZER_RANGE, rel=0.05)
    assert stds.mean().item() != pytest.approx(TE_DEFAULT_INIT_STD, rel=0.2)


def test_a_meta_model_outside_llm_foundry_keeps_te_default_init(fake_te):
    """No param_init_fn above a layer: TE's own init (weight N(0, 0.023), bias zeros)."""
    fake_te("2.20.2")
    with torch.device("meta"):
        net = nn.Module()
        net.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(2)])
    convert_to_fp8(net, SwapConfig(backend="te"))
    torch.manual_seed(0)
    for layer in net.layers:
        layer.reset_parameters()
        assert torch.equal(layer.bias, torch.zeros(64))
    weights = torch.cat([layer.weight.flatten() for layer in net.layers])
    assert weights.std().item() == pytest.approx(TE_DEFAULT_INIT_STD, rel=0.05)


# --- NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES against the recipe's use_power_2_scales ---

ENV = "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"


@pytest.mark.parametrize(("env", "power_2", "warned"), [
    ("1", False, True), ("0", True, True), ("yes", True, True),  # TE reads only "1" as on
    ("1", True, False), ("0", False, False), (None, True, False)])
def test_power_2_variable_disagreeing_with_the_recipe_is_warned_at_init(
        fake_te, monkeypatch, caplog, env, power_2, warned):
    from foundry_fp8.composer.te_swap import TESwap

    fake_te("2.20.2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    if env is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, env)
    with caplog.at_level("WARNING"):
        TESwap(backend="te", fp8_recipe={"scaling": "current", "use_power_2_scales": power_2})
    lines = [r.getMessage() for r in caplog.records if ENV in r.getMessage()]
    assert len(lines) == int(warned)
    if warned:
        assert f"use_power_2_scales: {str(env == '1').lower()}" in lines[0]


@pytest.mark.parametrize(("te", "warned"), [("2.7.0", False), ("2.8.0", True)])
def test_power_2_variable_is_warned_only_under_a_te_that_reads_it(
        fake_te, monkeypatch, caplog, te, warned):
    # TE reads the variable from 2.8 (common/recipe/__init__.py:230 at v2.8; absent at v2.7).
    from foundry_fp8.composer.te_swap import TESwap

    fake_te(te)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setenv(ENV, "1")
    with caplog.at_level("WARNING"):
        TESwap(backend="te", fp8_recipe={"scaling": "current", "use_power_2_scales": False})
    assert len([r for r in caplog.records if ENV in r.getMessage()]) == int(warned)


def test_power_2_variable_is_not_warned_under_delayed_scaling(fake_te, monkeypatch, caplog):
    from foundry_fp8.composer.te_swap import TESwap

    fake_te("2.20.2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setenv(ENV, "1")
    with caplog.at_level("WARNING"):
        TESwap(backend="te", fp8_recipe={"scaling": "delayed"})
    assert not [r for r in caplog.records if ENV in r.getMessage()]
