"""te_swap's `fuse_ln_mlp` for MPT's `ffn_act_fn: {name: relu}`: TE's LayerNormMLP `relu` is
`fmaxf(x, 0.f)` (transformer_engine/common/util/math.h:67-69 at v1.12, 101-103 at v2.18; in
`_act_func`, pytorch/module/layernorm_mlp.py, since v1.12), torch's relu on every number, so
the block is fused with `activation='relu'` (before: kept plain, "ffn_act_fn is not GELU"),
and its HF export keeps the config's relu (not TE's tanh GELU, which a GELU block's gets).

Reference: LLM-Foundry's own MPT block (its norm_2 and MLP, built from the config) on the same
weights; the fused side is tests/fake_te.py's te.LayerNormMLP, which computes TE's formulas.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import apply_swap, plan_swap, swapped_state_dict, te_activation

RELU = {"name": "relu"}


def _mpt(act_fn: dict) -> torch.nn.Module:
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    torch.manual_seed(0)
    return MPTForCausalLM(MPTConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=16, vocab_size=128,
        attn_config={"attn_impl": "torch"},
        ffn_config={"ffn_type": "mptmlp", "ffn_act_fn": act_fn}))


def test_a_relu_block_fuses_and_computes_the_plain_blocks_mlp(fake_te):
    fake_te()
    model = _mpt(RELU)
    plain = copy.deepcopy(model)
    plan = plan_swap(model, SwapConfig(backend="te", fuse_ln_mlp=True))
    fused_decisions = [d for d in plan.converted if d.kind == "ln_mlp"]
    assert [d.name for d in fused_decisions] == [f"transformer.blocks.{i}.ffn" for i in range(2)]
    assert {d.reason for d in fused_decisions} == {
        "fused norm_2+MLP; TE relu is exact, as the model's ffn_act_fn"}
    apply_swap(model, plan)
    x = torch.randn(2, 16, 64) * 3 + 1  # half the fc1 outputs negative: relu's 0 shows
    for fused_block, plain_block in zip(model.transformer.blocks, plain.transformer.blocks,
                                        strict=True):
        assert fused_block.ffn.activation == "relu"
        want = plain_block.ffn(plain_block.norm_2(x))
        got = fused_block.ffn(x)
        # only the norm's float order differs (TE's formula in fp32, torch's kernel)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


def test_te_activation_maps_mpts_built_activations():
    from llmfoundry.models.layers.ffn import resolve_ffn_act_fn

    assert te_activation(resolve_ffn_act_fn(RELU)) == "relu"
    assert te_activation(resolve_ffn_act_fn({"name": "relu", "inplace": True})) == "relu"
    assert te_activation(resolve_ffn_act_fn(None)) == "gelu"  # MPT's default, exact GELU
    assert te_activation(resolve_ffn_act_fn({"name": "silu"})) is None
    assert te_activation(resolve_ffn_act_fn({"name": "quick_gelu"})) is None
    assert te_activation(resolve_ffn_act_fn({"name": "leaky_relu"})) is None


def test_a_silu_block_stays_plain_with_the_reason(fake_te):
    fake_te()
    plan = plan_swap(_mpt({"name": "silu"}), SwapConfig(backend="te", fuse_ln_mlp=True))
    assert [d.reason for d in plan.decisions if d.kind == "ln_mlp"] == [
        "not fused: ffn_act_fn is not GELU or ReLU: TE's LayerNormMLP here maps only those"] * 2


def test_a_relu_fused_models_hf_export_keeps_relu(fake_te):
    """The exported config's ffn_act_fn (composer/plain.py `_te_activation`): relu as
    configured; a GELU model fused gets TE's tanh GELU."""
    from foundry_fp8.composer.plain import _te_activation

    fake_te()
    for act_fn, exported in [(RELU, RELU), ({"name": "gelu"},
                                            {"name": "gelu", "approximate": "tanh"})]:
        model = _mpt(act_fn)
        apply_swap(model, plan_swap(model, SwapConfig(backend="te", fuse_ln_mlp=True)))
        config = SimpleNamespace(ffn_config={"ffn_type": "mptmlp", "ffn_act_fn": act_fn})
        out = _te_activation(lambda c: c, model, [False])(config)
        assert out.ffn_config["ffn_act_fn"] == exported


@pytest.mark.parametrize(("ffn_act_fn", "refused"), [(RELU, False), ({"name": "gelu"}, True)])
def test_a_native_relu_te_ln_mlp_checkpoint_loads_into_a_relu_block(fake_te, ffn_act_fn,
                                                                    refused):
    """LLM-Foundry's `ffn_type: te_ln_mlp` with `activation: relu` is this run's block where the
    block's ffn_act_fn is relu (before: refused whatever the block computed)."""
    fake_te()
    fused = _mpt(RELU)
    apply_swap(fused, plan_swap(fused, SwapConfig(backend="te", fuse_ln_mlp=True)))
    saved = fused.state_dict()
    config = {"ffn_type": "te_ln_mlp", "activation": "relu"}
    target = _mpt(ffn_act_fn)
    if refused:
        with pytest.raises(ValueError, match="activation='relu'"):
            swapped_state_dict(saved, target, config)
        return
    swapped_state_dict(saved, target, config)
    target.load_state_dict(saved)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(target(ids).logits, fused(ids).logits, rtol=1e-4, atol=1e-4)
