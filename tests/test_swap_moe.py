"""te_swap on Hugging Face mixture-of-experts models (`hf_causal_lm` with a Mixtral or Qwen2-MoE):
each expert's GEMM gets the tokens routed to it, a count TE's FP8 GEMM refuses unless divisible
by 8, so experts and the router stay in high precision, and the FLOPs shares count the experts a
token really uses. Before, every expert and the router (with 16 experts it passes the shape
rule) were "converted": a te.Linear expert stops the first batch, and the table claimed 98 % of
the FLOPs in FP8."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from foundry_fp8 import FP8Recipe, SwapConfig, convert_to_fp8, fp8_autocast
from foundry_fp8.swap import linear_flops

H, FFN, EXPERTS, TOP_K, VOCAB = 64, 128, 16, 2, 256


def _mixtral() -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K))


def test_experts_see_token_counts_te_refuses_and_stay_in_high_precision():
    reference = _mixtral()
    counts: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda _, args: counts.append(args[0].shape[0]))
             for n, m in reference.named_modules() if n.endswith("experts.0.w1")
             or n.endswith("experts.1.w1")]
    ids = torch.randint(0, VOCAB, (2, 16))  # 32 tokens: every dense GEMM passes TE's rule
    with torch.no_grad():
        reference(ids)
    for hook in hooks:
        hook.remove()
    assert any(c % 8 for c in counts), counts  # what TE's assert_dim_for_fp8_exec refuses

    model = _mixtral()
    plan = convert_to_fp8(model, SwapConfig(backend="emulate"))
    kinds = {n: type(m) for n, m in model.named_modules()}
    experts = [n for n in kinds if ".experts." in n and n.endswith(("w1", "w2", "w3"))]
    routers = [n for n in kinds if n.endswith("block_sparse_moe.gate")]
    assert len(experts) == 2 * EXPERTS * 3 and len(routers) == 2
    assert all(kinds[n] is nn.Linear for n in experts + routers)
    reasons = {d.name: d.reason for d in plan.decisions}
    assert all(reasons[n].startswith("MoE expert") for n in experts)
    assert all(reasons[n].startswith("MoE router") for n in routers)
    assert sorted(d.name for d in plan.converted) == sorted(
        n for n in kinds if ".self_attn." in n and n.endswith("_proj"))

    # the shares by hand: per layer q, o 64x64; k, v 64x32 (GQA); 2 of 16 experts of 3 GEMMs
    # 64x128; the router 64x16; the untied LM head 64x256 (kept, keep_lm_head)
    attention, experts_used, router, head = 2 * 12288, 2 * TOP_K * 3 * H * FFN, 2 * H * EXPERTS, \
        2 * H * VOCAB
    total = 2 * (attention + experts_used + router) + head
    assert plan.total_flops == linear_flops(model) == total
    assert plan.fp8_flops_share == pytest.approx(2 * attention / total)


def test_a_converted_mixtral_trains_with_the_reference_routing_and_experts():
    """The router and experts of the converted model compute exactly the plain GEMM of their
    inputs (the reference: F.linear on the same weights), so the routing is high precision."""
    model = _mixtral()
    reference = copy.deepcopy(model)
    convert_to_fp8(model, SwapConfig(backend="emulate"))
    seen: list[tuple[torch.Tensor, torch.Tensor, nn.Linear]] = []
    for name, module in model.named_modules():
        if name.endswith(("block_sparse_moe.gate", "experts.3.w2")):
            module.register_forward_hook(lambda m, a, out: seen.append((a[0], out, m)))
    ids = torch.randint(0, VOCAB, (2, 16))
    with fp8_autocast(recipe=FP8Recipe()):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert seen and all(torch.equal(out, nn.functional.linear(x, m.weight, m.bias))
                        for x, out, m in seen)
    with torch.no_grad():
        expected = reference(ids, labels=ids).loss
    assert abs(loss.item() - expected.item()) < 0.02  # attention in FP8: within FP8 error
    assert all(m.weight.grad is not None for _, _, m in seen)


def test_a_qwen2_moe_keeps_its_experts_and_router_and_converts_its_shared_expert():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, moe_intermediate_size=FFN,
        shared_expert_intermediate_size=FFN, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=EXPERTS, num_experts_per_tok=TOP_K))
    plan = convert_to_fp8(model, SwapConfig(backend="emulate"))
    reasons = {d.name: d.reason for d in plan.decisions}
    assert reasons["model.layers.0.mlp.gate"].startswith("MoE router")
    assert reasons["model.layers.0.mlp.experts.5.down_proj"].startswith("MoE expert")
    assert reasons["model.layers.0.mlp.shared_expert.up_proj"] == "converted"  # every token
    assert "shape 1x64" in reasons["model.layers.0.mlp.shared_expert_gate"]



def test_experts_in_a_module_dict_nllb_moe_stay_in_high_precision():
    """NLLB-MoE (and SwitchTransformers) hold their experts in an nn.ModuleDict: the rule saw
    only ModuleLists, so every expert and the router were converted, though each expert gets a
    token count that changes every batch (measured here on the plain model)."""
    def nllb() -> nn.Module:
        torch.manual_seed(0)
        return transformers.NllbMoeForConditionalGeneration(transformers.NllbMoeConfig(
            vocab_size=VOCAB, d_model=H, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
            encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, num_experts=EXPERTS, expert_capacity=64,
            encoder_sparse_step=1, decoder_sparse_step=1, max_position_embeddings=64))

    reference = nllb().eval()
    counts: list[int] = []
    for name, module in reference.named_modules():
        if name.endswith(("experts.expert_0.fc1", "experts.expert_1.fc1")):
            module.register_forward_pre_hook(lambda _, args: counts.append(args[0].shape[0]))
    ids = torch.randint(4, VOCAB, (2, 16))
    with torch.no_grad():
        reference(input_ids=ids, decoder_input_ids=ids)
    assert any(c % 8 for c in counts), counts  # what TE's assert_dim_for_fp8_exec refuses

    model = nllb()
    plan = convert_to_fp8(model, SwapConfig(backend="emulate"))
    kinds = {n: type(m) for n, m in model.named_modules()}
    experts = [n for n in kinds if ".experts.expert_" in n and n.endswith(("fc1", "fc2"))]
    routers = [n for n in kinds if n.endswith("ffn.router.classifier")]
    assert len(experts) == 4 * EXPERTS * 2 and len(routers) == 4
    assert all(kinds[n] is nn.Linear for n in experts + routers)
    reasons = {d.name: d.reason for d in plan.decisions}
    assert all(reasons[n].startswith("MoE expert") for n in experts)
    assert all(reasons[n].startswith("MoE router") for n in routers)
    assert plan.converted
