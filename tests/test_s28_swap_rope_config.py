"""An MPT with `attn_config: {rope: true, rope_impl: hf}` holds a transformers
`LlamaRotaryEmbedding` whose `config` is LLM-Foundry's `PartialLlamaConfig`, which raises
`InvalidConfigAccessError` (a KeyError, not an AttributeError) on any key it does not allow
(llmfoundry/models/mpt/modeling_mpt.py, 0.22). te_swap's MoE scan read `num_experts_per_tok`
from every module's config, so every such run stopped at INIT with that bare KeyError.

Reference: the same MPT without rope (learned_pos_emb off in both): the same layers, plan and
linear FLOPs."""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import convert_to_fp8, linear_flops


def _mpt(rope: bool) -> torch.nn.Module:
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    torch.manual_seed(0)
    attn = {"attn_impl": "torch", "rope": rope, "rope_impl": "hf"}
    return MPTForCausalLM(
        MPTConfig(
            d_model=32,
            n_heads=2,
            n_layers=2,
            max_seq_len=16,
            vocab_size=64,
            learned_pos_emb=False,
            attn_config=attn,
        )
    )


def test_rope_hf_mpt_converts_as_the_mpt_without_rope():
    model, reference = _mpt(rope=True), _mpt(rope=False)
    rotary = model.transformer.rotary_embedding
    with pytest.raises(KeyError):  # what LLM-Foundry's config does to an unknown key
        rotary.config.num_experts_per_tok  # noqa: B018 (the read is the point)

    plan = convert_to_fp8(model, SwapConfig(backend="emulate"), precision="fp32")
    expected = convert_to_fp8(reference, SwapConfig(backend="emulate"), precision="fp32")

    assert [(d.name, d.convert, d.reason) for d in plan.decisions] == [
        (d.name, d.convert, d.reason) for d in expected.decisions
    ]
    assert len(plan.converted) == 8  # Wqkv, out_proj, up_proj, down_proj in each of 2 blocks
    assert linear_flops(model) == linear_flops(reference) == plan.total_flops
