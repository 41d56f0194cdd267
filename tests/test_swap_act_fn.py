"""te_swap's fuse_ln_mlp note on the GELU: TE's LayerNormMLP `gelu` is the tanh form
(transformer_engine/common/util/math.h); an MPT whose `ffn_act_fn` is already the tanh GELU
loses nothing by fusing, and the plan must not say it differs from an exact GELU it lacks."""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import is_te_gelu, plan_swap


def _fused_note(act_fn: dict | None) -> str:
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    ffn = {"ffn_type": "mptmlp", **({"ffn_act_fn": act_fn} if act_fn else {})}
    model = MPTForCausalLM(MPTConfig(d_model=64, n_heads=4, n_layers=1, max_seq_len=16,
                                     vocab_size=128, attn_config={"attn_impl": "torch"},
                                     ffn_config=ffn))
    x = torch.linspace(-3, 3, 7)
    act = model.transformer.blocks[0].ffn.act
    # what LLM-Foundry built, checked against torch's two GELUs, not against our reading of it
    assert torch.equal(act(x), torch.nn.functional.gelu(
        x, approximate=(act_fn or {}).get("approximate", "none")))
    plan = plan_swap(model, SwapConfig(backend="te", fuse_ln_mlp=True))
    (note,) = [d.reason for d in plan.decisions if d.kind == "ln_mlp" and d.convert]
    return note


@pytest.mark.parametrize("act_fn", [None, {"name": "gelu", "approximate": "none"}])
def test_an_exact_gelu_mpt_is_told_the_fused_gelu_differs(act_fn):
    assert "vs MPT's exact erf GELU" in _fused_note(act_fn)


def test_a_tanh_gelu_mpt_is_not_told_it_has_an_exact_gelu():
    note = _fused_note({"name": "gelu", "approximate": "tanh"})
    assert "exact" not in note and "as the model's ffn_act_fn" in note


@pytest.mark.parametrize("act_fn", [
    {"name": "gelu", "approximate": "tanh"}, {"name": "gelu"}, None,
    {"name": "gelu", "approximate": "none"}, {"name": "relu"}, {"name": "quick_gelu"}])
def test_is_te_gelu_judges_what_llm_foundry_builds_by_what_it_computes(act_fn):
    """`is_te_gelu` on the activation LLM-Foundry's MPT MLP built from `ffn_act_fn` (None: MPT's
    default) is true exactly where that activation computes torch's tanh GELU."""
    from llmfoundry.models.layers.ffn import build_mptmlp

    act = build_mptmlp(d_model=8, expansion_ratio=2, ffn_act_fn=act_fn).act
    x = torch.linspace(-4, 4, 81)
    computes_tanh = torch.equal(act(x), torch.nn.functional.gelu(x, approximate="tanh"))
    assert is_te_gelu(act) == computes_tanh
    assert computes_tanh == (act_fn == {"name": "gelu", "approximate": "tanh"})
