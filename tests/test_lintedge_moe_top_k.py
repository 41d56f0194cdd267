"""moe_top_k in a torch_dmoe ffn_config that is not a whole number from 1 to moe_num_experts.

LLM-Foundry 0.22's dMoE router (llmfoundry/models/layers/dmoe.py, LearnedRouter._top_k) takes
`scores.max` where moe_top_k == 1 and `torch.topk(scores, moe_top_k)` otherwise: a negative k
raises RuntimeError, a k that is no int TypeError, both at the first forward, while k = 0 raises
nothing: no token reaches an expert, the block adds zeros and its experts and router never get a
gradient. Before, the linter said nothing on any of them, and te_swap counted a top-k 0 block's
experts' FLOPs for every expert ("top-k ... not found").

Reference: LLM-Foundry's own builder (build_torch_dmoe) and forward on each value."""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.lint.rules import lint_config
from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import plan_swap

DMOE = {"ffn_type": "torch_dmoe", "moe_num_experts": 4, "moe_top_k": 2, "mlp_type": "mlp",
        "moe_jitter_eps": None, "moe_normalize_expert_weights": None,
        "uniform_expert_assignment": False}
SECTION = {"name": "mpt_causal_lm", "d_model": 16, "n_heads": 2, "n_layers": 1,
           "max_seq_len": 8, "vocab_size": 64, "loss_fn": "torch_crossentropy",
           "attn_config": {"attn_impl": "torch"}}
VALUES = [0, -1, 1, 1.0, True, False, 2, 4, 2.0, 1.5, "2", None, 5]


def _what_llmfoundry_does(top_k: object) -> str:
    """'ok', 'raises' or 'silent' (trains, no expert learns) for a residual block around the
    dMoE LLM-Foundry's build_torch_dmoe builds from this ffn_config."""
    from llmfoundry.models.layers.ffn import build_torch_dmoe

    torch.manual_seed(0)
    kwargs = {k: v for k, v in DMOE.items() if k != "ffn_type"}
    block = build_torch_dmoe(d_model=16, expansion_ratio=2, **{**kwargs, "moe_top_k": top_k})
    x = torch.randn(2, 4, 16, requires_grad=True)
    try:
        (x + block(x)).square().sum().backward()  # MPTBlock's residual around its ffn
    except (RuntimeError, TypeError):
        return "raises"
    grads = [p.grad for p in block.parameters()]
    return "ok" if all(g is not None and g.abs().sum() > 0 for g in grads) else "silent"


@pytest.mark.parametrize("top_k", VALUES, ids=repr)
def test_lint_errs_exactly_where_llmfoundrys_dmoe_raises_or_learns_nothing(top_k):
    does = _what_llmfoundry_does(top_k)
    model = {**SECTION, "ffn_config": {**DMOE, "moe_top_k": top_k}}
    found = [(f.key, f.severity) for f in lint_config({"model": model}) if f.rule == "FP8042"]
    assert found == ([] if does == "ok" else [("model.ffn_config.moe_top_k", "error")]), does
    if does == "silent":
        message = next(f.message for f in lint_config({"model": model}) if f.rule == "FP8042")
        assert "without error" in message and "never" in message


def test_te_swap_counts_no_flops_for_experts_no_token_reaches():
    from llmfoundry.models.mpt import ComposerMPTCausalLM

    plans = {}
    for top_k in (0, 2):
        section = {**SECTION, "ffn_config": {**DMOE, "moe_top_k": top_k}}
        kwargs = {k: v for k, v in section.items() if k != "name"}
        model = ComposerMPTCausalLM(tokenizer=None, init_device="meta", **kwargs)
        plans[top_k] = {d.name: d for d in plan_swap(model, SwapConfig()).decisions
                        if d.kind == "moe_experts"}
    assert list(plans[0]) == list(plans[2]) == ["model.transformer.blocks.0.ffn.experts"]
    none, two = plans[0].popitem()[1], plans[2].popitem()[1]
    assert two.flops > 0 and "the 2 of 4 experts" in two.reason
    assert none.flops == 0 and none.flops_share == 0 and "none: top-k 0" in none.reason


@pytest.mark.parametrize("experts", [0, -1, 4.0, "4", None, True, 1, 4], ids=repr)
def test_lint_errs_where_moe_num_experts_breaks_llmfoundrys_dmoe(experts):
    """moe_num_experts: 0 builds and fails at the first forward (IndexError in the router's
    max()); a negative or non-integer count fails building the router's weight."""
    from llmfoundry.models.layers.ffn import build_torch_dmoe

    kwargs = {k: v for k, v in DMOE.items() if k != "ffn_type"}
    try:
        block = build_torch_dmoe(d_model=16, expansion_ratio=2,
                                 **{**kwargs, "moe_num_experts": experts, "moe_top_k": 1})
        block(torch.randn(2, 4, 16))
        fails = False
    except (IndexError, RuntimeError, TypeError):
        fails = True
    model = {**SECTION, "ffn_config": {**DMOE, "moe_num_experts": experts, "moe_top_k": 1}}
    found = [(f.key, f.severity) for f in lint_config({"model": model}) if f.rule == "FP8042"]
    assert found == ([("model.ffn_config.moe_num_experts", "error")] if fails else [])
