"""te_swap on a PEFT (LoRA) model, as LLM-Foundry's `hf_causal_lm` with `peft_config` builds it:
the frozen `base_layer` of each adapted Linear runs in FP8, the rank-r adapters (`lora_A`,
`lora_B`) stay in high precision. Before, a rank-16 LoRA's adapters passed TE's shape rule and
were converted too: in a tiny LLM-Foundry run `lora_B` (zero at init) then showed 81-91 %
overflow of its FP8 weight at step 4.

The first test uses a stand-in of PEFT's tuner-layer layout (peft 0.16
tuners/tuners_utils.py:692 and tuners/lora/layer.py:83: `adapter_layer_names`, adapters in
ModuleDicts per adapter name, the wrapped module as `base_layer`), so it runs without PEFT; the
second uses PEFT itself where it is installed (LLM-Foundry's `peft` extra)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import convert_to_fp8

D, R = 64, 16


class LoraLinear(nn.Module):
    """PEFT's LoRA Linear layout: `base_layer` plus `lora_B(lora_A(x)) * scaling` per adapter."""

    adapter_layer_names = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(D, R, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(R, D, bias=False)})
        self.lora_embedding_A = nn.ParameterDict()
        self.lora_embedding_B = nn.ParameterDict()
        self.scaling = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.base_layer(x)
                + self.lora_B["default"](self.lora_A["default"](x)) * self.scaling)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = LoraLinear(nn.Linear(D, D, bias=False))
        self.o_proj = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.relu(self.q_proj(x)))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_lora_adapters_stay_in_high_precision_and_the_frozen_base_converts():
    torch.manual_seed(0)
    model = Tiny()
    for name, p in model.named_parameters():  # PEFT freezes all but the adapters
        p.requires_grad_("lora_" in name)
    adapters = {n: copy.deepcopy(m) for n, m in model.named_modules() if ".lora_" in n
                and isinstance(m, nn.Linear)}
    plan = convert_to_fp8(model, SwapConfig(backend="emulate"), precision="fp32")
    decisions = {d.name: d for d in plan.decisions}
    assert sorted(n for n, d in decisions.items() if d.convert) == [
        f"layers.{i}.{m}" for i in (0, 1) for m in ("o_proj", "q_proj.base_layer")]
    for name in adapters:
        assert decisions[name].reason.startswith("PEFT adapter (lora_")
    modules = dict(model.named_modules())
    assert all(type(modules[n]) is nn.Linear for n in adapters)
    assert isinstance(modules["layers.0.q_proj.base_layer"], EmulatedFP8Linear)
    # the adapter path computes exactly what the unconverted adapters compute
    x = torch.randn(4, D)
    layer = modules["layers.0.q_proj"]
    got = layer.lora_B["default"](layer.lora_A["default"](x))
    want = adapters["layers.0.q_proj.lora_B.default"](adapters["layers.0.q_proj.lora_A.default"](x))
    assert torch.equal(got, want)
    # a training step reaches the adapters only
    with fp8_autocast():
        model(x).square().mean().backward()
    assert all(modules[n].weight.grad is not None for n in adapters)
    assert modules["layers.0.q_proj.base_layer"].weight.grad is None


def test_peft_lora_on_a_llama_keeps_its_adapters_and_their_saved_keys():
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=D, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=128)
    model = peft.get_peft_model(LlamaForCausalLM(config), peft.LoraConfig(
        r=R, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    saved_before = peft.get_peft_model_state_dict(model)
    plan = convert_to_fp8(model, SwapConfig(backend="emulate"), precision="fp32")
    kept = {d.name for d in plan.decisions if d.reason.startswith("PEFT adapter")}
    assert len(kept) == 2 * 2 * 2  # layers x (q, v) x (A, B)
    modules = dict(model.named_modules())
    assert all(type(modules[n]) is nn.Linear for n in kept)
    assert isinstance(modules["base_model.model.model.layers.0.self_attn.q_proj.base_layer"],
                      EmulatedFP8Linear)
    saved_after = peft.get_peft_model_state_dict(model)  # what save_pretrained writes
    assert saved_after.keys() == saved_before.keys()
    assert all(torch.equal(saved_after[k], saved_before[k]) for k in saved_before)
    tokens = torch.randint(0, 128, (2, 16))
    with fp8_autocast():
        model(input_ids=tokens, labels=tokens).loss.backward()
    lora_b = modules["base_model.model.model.layers.1.self_attn.v_proj.lora_B.default"]
    assert lora_b.weight.grad is not None and lora_b.weight.grad.abs().sum() > 0
