"""A checkpoint whose MPT blocks hold a te.LayerNormMLP (te_swap's fused layout, or LLM-Foundry's
own `ffn_type: te_ln_mlp`) loaded where the running block is plain (QA 20, R2-20's finding).

LLM-Foundry's te_ln_mlp saves TE's `ffn._extra_state` beside the fused names, which a strict load
into the plain block refused as the one unexpected key; a gated TE activation (swiglu: fc1 holds
two projections, TE's module/layernorm_mlp.py `LayerNormMLP.__init__`) or another one named in the
checkpoint's config was renamed into a plain GELU MLP. A fused checkpoint loaded into a plain run
trades TE's tanh GELU for MPT's exact one, said only at INFO. References: the stand-in TE module's
own tensors (tests/fake_te.py keeps TE's names), the checkpoint file read with torch.load, torch's
two GELUs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_plain_interop import _plain_name, _te_run
from tests.tiny_run import run_folder

FUSED = {"fuse_ln_mlp": True, "convert_layernorm": True}
UNFUSED = {"fuse_ln_mlp": False, "convert_layernorm": False, "exclude": "ffn"}
D_MODEL, HIDDEN = 64, 256


def _plain_model() -> torch.nn.Module:
    """A te_swap MPT whose blocks stay plain: norm_2 and an MLP of te.Linear, whose
    `out_features` the fc1-rows check reads."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    from foundry_fp8.swap import SwapConfig, apply_swap, plan_swap

    model = MPTForCausalLM(MPTConfig(d_model=D_MODEL, n_heads=4, n_layers=1, expansion_ratio=4,
                                     max_seq_len=64, vocab_size=512,
                                     attn_config={"attn_impl": "torch"}))
    apply_swap(model, plan_swap(model, SwapConfig(backend="te", fuse_ln_mlp=False)))
    return model


def _native(model: torch.nn.Module, fc1_rows: int = HIDDEN) -> tuple[dict[str, Any], dict]:
    """`model`'s state dict with block 0's norm_2 + MLP as LLM-Foundry's te_ln_mlp saves it: a
    te.LayerNormMLP's own state dict, `_extra_state` included; and that module's tensors."""
    import transformer_engine.pytorch as te

    torch.manual_seed(3)
    ln_mlp = te.LayerNormMLP(D_MODEL, fc1_rows, device="cpu")
    for p in ln_mlp.parameters():
        torch.nn.init.normal_(p)
    own = ln_mlp.state_dict()
    assert "_extra_state" in own  # what TE saves, and te_swap's checkpoints leave out
    block = "transformer.blocks.0."
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith((block + "norm_2.", block + "ffn."))}
    state.update({f"{block}ffn.{k}": v for k, v in own.items()})
    return state, {k: v.clone() for k, v in own.items() if k != "_extra_state"}


def test_a_native_te_ln_mlp_checkpoint_loads_strictly_into_a_plain_block(fake_te):
    from foundry_fp8.swap import swapped_state_dict

    fake_te("2.20.2")
    model = _plain_model()
    state, tensors = _native(model)
    swapped_state_dict(state, model, {"ffn_type": "te_ln_mlp", "bias": True})
    model.load_state_dict(state, strict=True)  # the old code: Unexpected key ffn._extra_state
    block = model.transformer.blocks[0]
    for te_name, plain in {"layer_norm_weight": block.norm_2.weight,
                           "layer_norm_bias": block.norm_2.bias,
                           "fc1_weight": block.ffn.up_proj.weight,
                           "fc1_bias": block.ffn.up_proj.bias,
                           "fc2_weight": block.ffn.down_proj.weight,
                           "fc2_bias": block.ffn.down_proj.bias}.items():
        assert torch.equal(plain.detach(), tensors[te_name]), te_name


@pytest.mark.parametrize("ffn_config,fc1_rows,named", [
    (None, 2 * HIDDEN, "fc1 has 512 rows, twice this run's 256 (a gated activation such as "
                       "swiglu, or another expansion_ratio)"),
    ({"ffn_type": "te_ln_mlp", "activation": "swiglu"}, 2 * HIDDEN, "activation='swiglu'"),
    ({"ffn_type": "te_ln_mlp", "activation": "relu"}, HIDDEN, "activation='relu'"),
    ({"ffn_type": "te_ln_mlp", "normalization": "RMSNorm"}, HIDDEN, "normalization='RMSNorm'"),
], ids=["swiglu-by-shape", "swiglu", "relu", "rmsnorm"])
def test_a_te_ln_mlp_no_plain_block_computes_is_refused_in_one_line(fake_te, ffn_config,
                                                                    fc1_rows, named):
    """Before: renamed into the plain GELU MLP (relu, RMSNorm: loaded silently as another
    function; swiglu: torch's size mismatch naming up_proj)."""
    from foundry_fp8.swap import swapped_state_dict

    fake_te("2.20.2")
    model = _plain_model()
    state, _ = _native(model, fc1_rows)
    with pytest.raises(ValueError) as raised:
        swapped_state_dict(state, model, ffn_config)
    message = str(raised.value)
    assert "\n" not in message
    assert "transformer.blocks.0.ffn is a te.LayerNormMLP" in message and named in message


def _fused_checkpoint(tmp_path: Path, tiny_data, monkeypatch, fake_te) -> Path:
    _te_run(tmp_path / "a", tiny_data, monkeypatch, fake_te, {"algorithms": {"te_swap": FUSED}})
    return run_folder(tmp_path / "a") / "checkpoints" / "ep0-ba2-rank0.pt"


@pytest.mark.filterwarnings("ignore")
def test_a_fused_checkpoint_into_a_plain_run_warns_once_of_the_gelu_change(
        tmp_path, tiny_data, monkeypatch, fake_te, plain_warnings):
    checkpoint = _fused_checkpoint(tmp_path, tiny_data, monkeypatch, fake_te)
    load = {"algorithms": {"te_swap": UNFUSED}, "load_path": str(checkpoint),
            "load_weights_only": True, "max_duration": "3ba"}
    _, warned = plain_warnings(lambda: _te_run(tmp_path / "b", tiny_data, monkeypatch, fake_te,
                                                load))
    gelu = [m for m in warned if "GELU" in m]
    assert len(gelu) == 1, warned  # the old code: 0 (INFO only)
    x = torch.linspace(-8, 8, 16001, dtype=torch.float64)
    bound = (torch.nn.functional.gelu(x, approximate="tanh") - torch.nn.functional.gelu(x))
    assert gelu[0].startswith("te_swap: 2 block(s) of the checkpoint")  # the tiny MPT's 2
    assert f"{bound.abs().max().item():.1e} apart" in gelu[0]
    assert "ffn_config.ffn_act_fn: {name: gelu, approximate: tanh}" in gelu[0]

    # the fix it names: the plain blocks compute TE's GELU, nothing to warn of
    tanh = {**load, "model": {"ffn_config": {"ffn_act_fn": {"name": "gelu",
                                                            "approximate": "tanh"}}}}
    _, warned = plain_warnings(lambda: _te_run(tmp_path / "c", tiny_data, monkeypatch, fake_te,
                                                tanh))
    assert not [m for m in warned if "GELU" in m], warned


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("activation", [None, "relu"])
def test_a_native_te_ln_mlp_composer_checkpoint_loads_or_is_refused_by_its_config(
        tmp_path, tiny_data, monkeypatch, fake_te, activation):
    """The fused checkpoint made LLM-Foundry-native: TE's `ffn._extra_state` per block and
    `ffn_type: te_ln_mlp` in the config Composer saves with it. Default TE keywords: a strict
    weights-only load into a plain run takes every tensor (the old code: Unexpected key(s)
    ffn._extra_state); `activation: relu`: refused by the saved config."""
    checkpoint = _fused_checkpoint(tmp_path, tiny_data, monkeypatch, fake_te)
    whole = torch.load(checkpoint, map_location="cpu", weights_only=False)
    state = whole["state"]
    for i in range(2):
        state["model"][f"model.transformer.blocks.{i}.ffn._extra_state"] = torch.zeros(
            0, dtype=torch.uint8)
    config = state["integrations"]["huggingface"]["model"]["config"]["content"]
    config["ffn_config"] = {"ffn_type": "te_ln_mlp", "bias": True,
                            **({"activation": activation} if activation else {})}
    native = tmp_path / "native.pt"
    torch.save(whole, native)
    weights = {_plain_name(k.removeprefix("model.")): v for k, v in state["model"].items()
               if not k.endswith("_extra_state")}

    load = {"algorithms": {"te_swap": UNFUSED}, "load_path": str(native),
            "load_weights_only": True, "load_strict_model_weights": True, "max_duration": "2ba",
            "save_interval": "1000ba"}
    if activation:
        with pytest.raises(ValueError, match="ffn_type te_ln_mlp.* with activation='relu'"):
            _te_run(tmp_path / "b", tiny_data, monkeypatch, fake_te, load)
        return
    seen: dict[str, torch.Tensor] = {}
    import composer

    fit = composer.Trainer.fit

    def snapshot(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.update({n.removeprefix("model."): p.detach().clone()
                     for n, p in self.state.model.named_parameters()})
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(composer.Trainer, "fit", snapshot)
    _te_run(tmp_path / "b", tiny_data, monkeypatch, fake_te, load)
    assert sorted(seen) == sorted(weights)
    for name, value in weights.items():
        assert torch.equal(seen[name], value), name
