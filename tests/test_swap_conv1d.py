"""te_swap on GPT-2, whose block GEMMs are transformers `Conv1D`s (weight [in, out]), not
`nn.Linear`s. Before, te_swap's plan did not see them: in `llmfoundry train` with an
`hf_causal_lm` GPT-2 the refusal named only the tied LM head ("every layer kept: weight tied to
model.transformer.wte") and advised relaxing keep_first/last_blocks, and the FLOPs total left
out 8 of the 9 GEMMs; with a LoRA, the adapters' reason said their Conv1D base layers ran in
FP8."""

from __future__ import annotations

import pytest

from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import convert_to_fp8, linear_flops, plan_swap

D, VOCAB, LAYERS = 64, 512, 2


def _gpt2():
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=D, n_head=4, n_layer=LAYERS, vocab_size=VOCAB, n_positions=64))


def _by_hand() -> int:
    """GPT-2's forward GEMM FLOPs per token, 2 per multiply-add: per block c_attn (D -> 3D),
    attn.c_proj (D -> D), c_fc (D -> 4D), mlp.c_proj (4D -> D); the LM head (D -> vocab)."""
    block = D * 3 * D + D * D + D * 4 * D + 4 * D * D
    return 2 * (LAYERS * block + D * VOCAB)


def test_gpt2s_conv1d_layers_are_planned_kept_with_their_reason():
    model = _gpt2()
    plan = plan_swap(model, SwapConfig(backend="emulate"), precision="fp32")
    conv = [d for d in plan.decisions if "Conv1D" in d.reason]
    assert sorted(d.name for d in conv) == sorted(
        f"transformer.h.{i}.{m}" for i in range(LAYERS)
        for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert not any(d.convert for d in plan.decisions)
    assert plan.total_flops == linear_flops(model) == _by_hand()
    fc = next(d for d in conv if d.name == "transformer.h.0.mlp.c_fc")
    assert (fc.in_features, fc.out_features, fc.params) == (D, 4 * D, D * 4 * D + 4 * D)
    assert sum(d.flops_share for d in plan.decisions) == pytest.approx(1.0)


def test_a_gpt2_is_refused_naming_conv1d():
    """No option of te_swap's converts a Conv1D or a tied head: the refusal says so, where it
    advised relaxing keep_first/last_blocks, include/exclude, min_gemm_size or module_filter_fn,
    none of which the plan used."""
    with pytest.raises(ValueError, match="Conv1D") as refusal:
        convert_to_fp8(_gpt2(), SwapConfig(backend="emulate"), precision="fp32")
    assert str(refusal.value).endswith(
        "; no te_swap option converts these layers, or do not ask for FP8")
    assert "relax" not in str(refusal.value)


def test_a_refusal_names_only_the_options_that_kept_layers():
    from torch import nn

    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(64, 64), nn.Linear(64, 64)])
    model.lm_head = nn.Linear(64, 128)
    with pytest.raises(ValueError) as refusal:
        convert_to_fp8(model, SwapConfig(backend="emulate", include="blocks\\.0", exclude="0"))
    message = str(refusal.value)
    assert message.endswith("; relax include, exclude, keep_lm_head, or do not ask for FP8")
    for reason in ("not matched by include", "matched by exclude",
                   "LM head kept in high precision (keep_lm_head)"):
        assert reason in message


def test_a_lora_on_gpt2_does_not_claim_its_base_layer_runs_in_fp8():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_gpt2(), peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=["c_attn"], task_type="CAUSAL_LM"))
    plan = plan_swap(model, SwapConfig(backend="emulate"), precision="fp32")
    decisions = {d.name: d for d in plan.decisions}
    base = decisions["base_model.model.transformer.h.0.attn.c_attn.base_layer"]
    assert not base.in_fp8 and "Conv1D" in base.reason
    adapters = [d for d in plan.decisions if d.reason.startswith("PEFT adapter")]
    assert len(adapters) == LAYERS * 2
    assert not any("runs in FP8" in d.reason for d in adapters)
