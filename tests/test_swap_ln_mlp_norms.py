"""te_swap's `fuse_ln_mlp` for each MPT `norm_type`: a block is fused only where te.LayerNormMLP
computes its norm_2 + MLP, with TE's `normalization` and the block's eps and biases, else kept
plain with the reason in the coverage table. Before, RMSNorm blocks were never fused, and the
backend left `normalization` and `zero_centered_gamma` to TE's defaults.

Reference: LLM-Foundry's own MPT block (its norm_2 and MLP, built from the config) on the same
weights; the fused side is tests/fake_te.py's te.LayerNormMLP, which computes TE's formulas
(`te.facts.LN_MLP_NORMALIZATIONS`: transformer_engine/pytorch/module/layernorm.py:22-23,
rmsnorm.py:23-29 at v2.18). `ffn_act_fn` is TE's tanh GELU so the two compute one function.
"""

from __future__ import annotations

import copy

import pytest
import torch

from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import apply_swap, plan_swap, te_normalization

NORM_EPS = 1e-3  # not TE's default 1e-5: a fusion that dropped the block's eps would show


def _mpt(norm_type: str, no_bias: bool) -> torch.nn.Module:
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=16, vocab_size=128, norm_type=norm_type,
        norm_eps=NORM_EPS, no_bias=no_bias, attn_config={"attn_impl": "torch"},
        ffn_config={"ffn_type": "mptmlp", "ffn_act_fn": {"name": "gelu", "approximate": "tanh"}}))
    with torch.no_grad():  # off MPT's init (ones, zeros): gamma vs 1 + gamma must show
        for block in model.transformer.blocks:
            for param in block.norm_2.parameters():
                param.add_(torch.randn_like(param) * 0.5)
    return model


FUSED = [("low_precision_layernorm", False, "LayerNorm"), ("layernorm", False, "LayerNorm"),
         ("rmsnorm", False, "RMSNorm"), ("low_precision_rmsnorm", False, "RMSNorm"),
         ("rmsnorm", True, "RMSNorm"), ("low_precision_rmsnorm", True, "RMSNorm")]


@pytest.mark.parametrize(("norm_type", "no_bias", "normalization"), FUSED)
def test_a_fused_block_computes_the_plain_blocks_norm_and_mlp(fake_te, norm_type, no_bias,
                                                              normalization):
    fake_te()
    model = _mpt(norm_type, no_bias)
    plain = copy.deepcopy(model)
    plan = plan_swap(model, SwapConfig(backend="te", fuse_ln_mlp=True))
    assert [d.name for d in plan.converted if d.kind == "ln_mlp"] == [
        f"transformer.blocks.{i}.ffn" for i in range(2)]
    apply_swap(model, plan)
    x = torch.randn(2, 16, 64) * 3 + 1
    for fused_block, plain_block in zip(model.transformer.blocks, plain.transformer.blocks, strict=True):
        fused = fused_block.ffn
        assert type(fused).__name__ == "LayerNormMLP" and fused_block.norm_2 is None
        assert fused.normalization == normalization and fused.eps == NORM_EPS
        assert not fused.zero_centered_gamma
        assert (fused.layer_norm_bias is None) == (normalization == "RMSNorm")
        # TE keeps a bias-free GEMM's bias as an empty plain tensor (tests/fake_te.py `_no_bias`)
        assert ("fc1_bias" in dict(fused.named_parameters())) is not no_bias
        want = plain_block.ffn(plain_block.norm_2(x))
        got = fused(x)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)


def test_a_layernorm_without_bias_is_kept_plain_with_the_reason(fake_te):
    """MPT's `no_bias` drops the LayerNorms' biases; te.LayerNormMLP's LayerNorm trains one."""
    fake_te()
    model = _mpt("low_precision_layernorm", no_bias=True)
    plan = plan_swap(model, SwapConfig(backend="te", fuse_ln_mlp=True))
    notes = [d.reason for d in plan.decisions if d.kind == "ln_mlp"]
    assert notes == ["not fused: norm has no bias (no_bias): te.LayerNormMLP's LayerNorm "
                     "trains one"] * 2
    apply_swap(model, plan)
    assert all(b.norm_2 is not None and hasattr(b.ffn, "up_proj")
               for b in model.transformer.blocks)


def test_norms_te_cannot_compute_as_the_block_has_them_say_why():
    """triton_rmsnorm (LLM-Foundry's class; building it needs flash-attn, absent here, so it is
    made without its constructor), an RMSNorm whose eps torch picks per call, one without
    weight."""
    from llmfoundry.models.layers.norm import TritonRMSNorm

    triton = TritonRMSNorm.__new__(TritonRMSNorm)
    torch.nn.Module.__init__(triton)
    triton.eps, triton.weight = 1e-5, torch.nn.Parameter(torch.ones(64))
    assert te_normalization(triton, 64).startswith("norm TritonRMSNorm is not torch's")
    assert te_normalization(torch.nn.RMSNorm(64), 64).startswith("RMSNorm eps is None")
    assert te_normalization(torch.nn.RMSNorm(64, eps=1e-5, elementwise_affine=False),
                            64).startswith("norm has no weight")
    assert te_normalization(torch.nn.LayerNorm(32), 64).startswith("norm over (32,)")
    assert te_normalization(torch.nn.RMSNorm(64, eps=1e-5), 64) == "RMSNorm"


def test_the_stand_in_refuses_what_te_refuses(fake_te):
    """TE 1.12-2.18 assert the normalization (layernorm_mlp.py:1299 at v1.12, 1984 at v2.18)
    and raise in the forward for an activation `_act_func` lacks."""
    fake_te()
    import transformer_engine.pytorch as te

    with pytest.raises(AssertionError, match="Unsupported normalization type"):
        te.LayerNormMLP(64, 256, normalization="BatchNorm", device="cpu")
    layer = te.LayerNormMLP(64, 256, activation="gelu_erf", device="cpu")
    with pytest.raises(NotImplementedError, match="gelu_erf is not supported"):
        layer(torch.randn(2, 64))


def test_zero_centered_gamma_is_tes_one_plus_gamma(fake_te):
    """The stand-in's `zero_centered_gamma` (TE's docstring formula, layernorm_mlp.py:1872-1878
    at v2.18): gamma - 1 stored, the same output."""
    fake_te()
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    a = te.LayerNormMLP(64, 128, normalization="RMSNorm", device="cpu")
    b = te.LayerNormMLP(64, 128, normalization="RMSNorm", zero_centered_gamma=True, device="cpu")
    b.load_state_dict({**a.state_dict(), "layer_norm_weight": a.layer_norm_weight - 1})
    x = torch.randn(4, 64)
    assert torch.allclose(a(x), b(x), rtol=1e-5, atol=1e-4)
    b.load_state_dict(a.state_dict())  # the same gamma read as 1 + gamma: another output
    assert not torch.allclose(a(x), b(x), atol=1e-3)


@pytest.mark.parametrize(("norm_type", "refused"), [("rmsnorm", False), ("layernorm", True)])
def test_a_native_rmsnorm_te_ln_mlp_checkpoint_loads_into_an_rmsnorm_block(fake_te, norm_type,
                                                                         refused):
    """LLM-Foundry's `ffn_type: te_ln_mlp` with `normalization: RMSNorm` is this run's block
    where the block's norm_2 is an RMSNorm (before: refused as for any other norm)."""
    from foundry_fp8.swap import swapped_state_dict

    fake_te()
    fused = _mpt("rmsnorm", no_bias=False)
    apply_swap(fused, plan_swap(fused, SwapConfig(backend="te", fuse_ln_mlp=True)))
    saved = fused.state_dict()
    config = {"ffn_type": "te_ln_mlp", "normalization": "RMSNorm"}
    target = _mpt(norm_type, no_bias=False)
    if refused:
        with pytest.raises(ValueError, match="normalization='RMSNorm'"):
            swapped_state_dict(saved, target, config)
        return
    renames = swapped_state_dict(saved, target, config)
    assert renames["transformer.blocks.0.ffn.layer_norm_weight"] == \
        "transformer.blocks.0.norm_2.weight"
    target.load_state_dict(saved)  # strict: every key this model has, none it lacks
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(target(ids).logits, fused(ids).logits, rtol=1e-4, atol=1e-4)
