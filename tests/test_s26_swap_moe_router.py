"""An MoE block whose experts are one module of weights, not linears (LLM-Foundry's
`torch_dmoe` and megablocks' dMoE, transformers' Llama 4) keeps its `router` linear in high
precision, as te_swap keeps Mixtral's `gate`: the router converted to FP8 wherever the experts
were a multiple of 16 (16 in Llama 4 Scout), its top-k choice made from FP8 logits.

Reference: the models as LLM-Foundry and transformers build them; the swapped MPT's logits
against its own before the swap (tests/fake_te.py's te.Linear)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import convert_to_fp8, plan_swap

ROUTER = "MoE router: its logits choose the experts, kept in high precision"


def test_llm_foundry_torch_dmoe_router_stays_and_the_logits_stay(fake_te):
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    fake_te()
    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(
        d_model=32, n_heads=2, n_layers=1, max_seq_len=8, vocab_size=64,
        attn_config={"attn_impl": "torch"},
        ffn_config={"ffn_type": "torch_dmoe", "moe_num_experts": 16, "moe_top_k": 2,
                    "mlp_type": "glu", "ffn_act_fn": {"name": "silu"}, "moe_jitter_eps": 0.0,
                    "moe_normalize_expert_weights": 1, "uniform_expert_assignment": False}))
    plain = copy.deepcopy(model).eval()
    plan = convert_to_fp8(model.eval(), SwapConfig(backend="te"))

    decisions = {d.name: d for d in plan.decisions}
    router = decisions["transformer.blocks.0.ffn.router.layer"]
    assert not router.convert and router.reason.startswith(ROUTER)
    assert type(model.transformer.blocks[0].ffn.router.layer) is nn.Linear
    assert decisions["transformer.blocks.0.attn.Wqkv"].convert
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)


def test_llama4_router_stays_and_its_shared_expert_converts():
    transformers = pytest.importorskip("transformers")
    config = transformers.Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, intermediate_size_mlp=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1)
    model = transformers.Llama4ForCausalLM(config)
    plan = plan_swap(model, SwapConfig(backend="te"))

    decisions = {d.name: d for d in plan.decisions}
    router = decisions["model.layers.0.feed_forward.router"]
    assert not router.convert and router.reason.startswith(ROUTER)
    assert decisions["model.layers.0.feed_forward.shared_expert.up_proj"].convert
