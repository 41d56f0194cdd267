"""te_swap judges a layer subclass by what its own forward computes. A torch LayerNorm/RMSNorm
subclass with its own forward stays as it is, with its reason:
te_swap's `convert_layernorm` turned transformers' NemotronLayerNorm1P (`weight + 1`, NVIDIA's
Nemotron/Minitron) into a te.LayerNorm scaling by `weight`, and `fuse_ln_mlp` would fuse such a
norm_2 into te.LayerNormMLP's: a silently different model (logits off by their own size).

Reference: the model's own forward before the swap (transformers' Nemotron, LLM-Foundry's MPT),
against the swapped model with tests/fake_te.py's TE modules, which compute TE's formulas.
LLM-Foundry's low-precision norms (its MPT default) compute their parent's function and still
convert and fuse (tests/test_swap_ln_mlp_norms.py). transformers' FalconLinear computes
nn.Linear's function in its own forward: Falcon's linears now convert, where te_swap refused a
Falcon model ("no module would run in FP8": every linear kept as a subclass). An MPT ffn whose
class has its own forward (a user's registered ffn on MPTMLP's layers) is not fused either: the
fused te.LayerNormMLP computes MPTMLP's `down_proj(act(up_proj(x)))` only.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from foundry_fp8.options import SwapConfig
from foundry_fp8.swap import convert_to_fp8

OWN_FORWARD = "an nn.LayerNorm subclass with its own forward, which TE's LayerNorm would not compute"


def test_nemotron_layernorm1p_is_kept_and_the_logits_stay(fake_te):
    transformers = pytest.importorskip("transformers")
    fake_te()
    torch.manual_seed(0)
    config = transformers.NemotronConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # Nemotron's trained gammas are near 0: weight + 1 is what counts
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.1)
    plain = copy.deepcopy(model)
    plan = convert_to_fp8(model, SwapConfig(backend="te", convert_layernorm=True))

    norms = [d for d in plan.decisions if d.kind == "layernorm"]
    assert len(norms) == 3 and not any(d.convert for d in norms)  # 2 in the layer, norm
    assert all(d.reason == f"NemotronLayerNorm1P: {OWN_FORWARD}" for d in norms)
    assert type(model.model.norm).__name__ == "NemotronLayerNorm1P"
    assert any(type(m).__name__ == "Linear" and type(m).__module__.startswith(
        "transformer_engine") for m in model.modules())  # the linears did convert
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)


class _OnePlus(nn.LayerNorm):
    """Nemotron's norm in a user's MPT registry: gamma is stored zero-centred."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias,
                                        self.eps)


def test_an_mpt_norm_2_with_its_own_forward_is_not_fused(fake_te):
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    fake_te()
    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(
        d_model=32, n_heads=2, n_layers=2, max_seq_len=8, vocab_size=64,
        attn_config={"attn_impl": "torch"},
        ffn_config={"ffn_type": "mptmlp", "ffn_act_fn": {"name": "gelu", "approximate": "tanh"}}))
    own = _OnePlus(32)
    with torch.no_grad():
        own.weight.normal_(0.0, 0.1)
    model.transformer.blocks[1].norm_2 = own
    plain = copy.deepcopy(model).eval()
    plan = convert_to_fp8(model.eval(), SwapConfig(backend="te", fuse_ln_mlp=True))

    fused = {d.name: (d.convert, d.reason) for d in plan.decisions if d.kind == "ln_mlp"}
    assert fused == {
        "transformer.blocks.0.ffn": (True, fused["transformer.blocks.0.ffn"][1]),
        "transformer.blocks.1.ffn": (False, f"not fused: norm _OnePlus: {OWN_FORWARD}")}
    assert model.transformer.blocks[1].norm_2 is own  # its linears converted one by one
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # block 0's tanh GELU is the plain model's too
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)


def test_falcon_linears_convert_and_the_logits_stay(fake_te):
    transformers = pytest.importorskip("transformers")
    fake_te()
    torch.manual_seed(0)
    config = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, new_decoder_architecture=True,
                                       num_kv_heads=1)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    plain = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = convert_to_fp8(model, SwapConfig(backend="te"), optimizers=optimizer)

    assert sorted(d.name.rpartition(".")[2] for d in plan.converted) == [
        "dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"]
    layer = model.transformer.h[0]
    assert type(layer.self_attention.query_key_value).__module__.startswith("transformer_engine")
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(model.parameters())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-6, atol=1e-6)


def test_an_mpt_mlp_with_its_own_forward_is_not_fused(fake_te):
    from llmfoundry.models.layers.ffn import MPTMLP
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    class HalfMLP(MPTMLP):
        """A user's registered ffn: MPTMLP's layers, its output halved."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 0.5 * super().forward(x)

    fake_te()
    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(
        d_model=32, n_heads=2, n_layers=1, max_seq_len=8, vocab_size=64,
        attn_config={"attn_impl": "torch"},
        ffn_config={"ffn_type": "mptmlp", "ffn_act_fn": {"name": "gelu", "approximate": "tanh"}}))
    block = model.transformer.blocks[0]
    block.ffn.__class__ = HalfMLP
    plain = copy.deepcopy(model).eval()
    plan = convert_to_fp8(model.eval(), SwapConfig(backend="te", fuse_ln_mlp=True))

    [fused] = [d for d in plan.decisions if d.kind == "ln_mlp"]
    assert not fused.convert and fused.reason == (
        "not fused: ffn HalfMLP has its own forward, not MPTMLP's down_proj(act(up_proj(x))) "
        "that te.LayerNormMLP computes")
    assert type(block.ffn) is HalfMLP and block.norm_2 is not None
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)


def test_remote_code_copies_of_llm_foundry_classes_count_as_theirs():
    """An MPT loaded with trust_remote_code (an LLM-Foundry export, the Hub's) has LLM-Foundry's
    classes from `transformers_modules.<folder>.<file>`: its norms still convert and fuse, its
    MLPs fuse (tests/test_swap_export_logits.py builds MPTs after such a load). A same-named
    class of another file is not taken for them."""
    from llmfoundry.models.layers.ffn import MPTMLP
    from llmfoundry.models.layers.norm import LPLayerNorm

    from foundry_fp8.swap import MPT_MLP_CLASS, forward_of, norm_forward_reason

    def copy_of(cls: type, module: str) -> type:
        return type(cls.__name__, cls.__bases__, {"forward": cls.forward, "__module__": module,
                                                  "__qualname__": cls.__qualname__})

    assert norm_forward_reason(copy_of(LPLayerNorm, "transformers_modules.ba2.norm")(8)) is None
    assert norm_forward_reason(copy_of(LPLayerNorm, "transformers_modules.ba2.other")(8)) == (
        f"LPLayerNorm: {OWN_FORWARD}")
    remote = copy_of(MPTMLP, "transformers_modules.ba2.ffn")
    elsewhere = copy_of(MPTMLP, "transformers_modules.ba2.blocks")
    assert forward_of(remote.__new__(remote), frozenset({MPT_MLP_CLASS}))
    assert not forward_of(elsewhere.__new__(elsewhere), frozenset({MPT_MLP_CLASS}))
