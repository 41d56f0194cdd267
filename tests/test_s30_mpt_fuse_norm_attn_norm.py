"""te_swap `fuse_ln_mlp` on an MPT built with `fuse_norm_attn_norm: true`: the block's norm_2
lives in `norm_attn_norm` (LLM-Foundry's FusedNormAttentionNorm, llmfoundry/models/layers/
blocks.py), so no MLP fuses; the plan says so per block instead of leaving the option silent."""

from __future__ import annotations

from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import apply_swap, coverage_table, plan_swap


def test_fuse_ln_mlp_with_fuse_norm_attn_norm_says_why_each_mlp_is_not_fused(fake_te):
    fake_te()
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    model = MPTForCausalLM(MPTConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=16, vocab_size=128,
        attn_config={"attn_impl": "torch"}, fuse_norm_attn_norm=True))
    plan = plan_swap(model, SwapConfig(backend="te", fuse_ln_mlp=True))
    rows = {d.name: d for d in plan.decisions if d.kind == "ln_mlp"}
    assert sorted(rows) == ["transformer.blocks.0.ffn", "transformer.blocks.1.ffn"]
    assert all(not d.in_fp8 and "fuse_norm_attn_norm" in str(d.reason) for d in rows.values())
    assert "fuse_norm_attn_norm" in coverage_table(plan)
    # the MLPs' linears still convert one by one, and the block still runs
    assert apply_swap(model, plan) == 8
    assert model.transformer.blocks[0].norm_attn_norm.norm_2 is not None
