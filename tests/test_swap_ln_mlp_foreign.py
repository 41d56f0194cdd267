"""LLM-Foundry's own `ffn_type: te_ln_mlp` checkpoints loaded where te_swap runs MPT's norm_2 +
MLP (plain, or fused by te_swap), whole-file and sharded (QA 21, R1's findings).

LLM-Foundry's `build_te_ln_mlp` passes `norm_type` on to nothing (llmfoundry/models/layers/
ffn.py:261-286, 0.22): a `norm_type: rmsnorm` model's te.LayerNormMLP is TE's default LayerNorm,
with a `layer_norm_bias`. Such a checkpoint loaded silently into an RMSNorm block (the bias
dropped as an unexpected key; logits off by units): the whole-file check compared only the keys
the config states. The sharded (DCP) path renamed any te.LayerNormMLP into a plain block with no
check at all (a `relu` one into a GELU block, a LayerNorm one into RMSNorm); both now refuse
in one line, by the same rule (`swap.refuse_foreign_ln_mlps`).

The checkpoints are LLM-Foundry's: its own MPT builder makes the te.LayerNormMLP (tests/
fake_te.py's, which keeps TE's parameter names and formulas). The accepted cases are checked
against the saving model's own logits or weights, so a refusal too broad fails as well.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import pytest
import torch

from foundry_fp8.swap import SwapConfig, apply_swap, plan_swap, swapped_state_dict
from tests.test_plain_interop import _plain_name
from tests.test_swap_sharded_layout import one_rank_env

#: TE's gelu is the tanh form: a plain block computing it is the native block's function
TANH_GELU = {"name": "gelu", "approximate": "tanh"}
MPT = {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 16, "vocab_size": 128,
       "attn_config": {"attn_impl": "torch"}, "norm_eps": 1e-5,
       "init_config": {"name": "default_"}}  # LLM-Foundry's other inits raise on te_ln_mlp
#: the one-line refusals, by what the checkpoint's te.LayerNormMLP is
LAYERNORM_BY_CONFIG = "with normalization='LayerNorm' (TE's default)"
LAYERNORM_BY_KEYS = "with LayerNorm (by its keys: a ffn.layer_norm_bias)"
RELU_BY_CONFIG = "(LLM-Foundry's ffn_type te_ln_mlp) with activation='relu'"


@pytest.fixture
def te_ln_mlp(fake_te, monkeypatch):
    """LLM-Foundry builds `ffn_type: te_ln_mlp` on the stand-in TE, on the CPU: it registers
    the builder and imports TE in its modules only where TE imported first (ffn.py:24-28,
    592-593; param_init_fns.py:29-32), and TE's modules default to `device='cuda'`, which
    `build_te_ln_mlp` does not pass."""
    import catalogue
    import llmfoundry.models.layers.ffn as ffn
    import llmfoundry.models.utils.param_init_fns as init_fns
    from llmfoundry.layers_registry import ffns_with_norm

    fake_te()
    import transformer_engine.pytorch as te

    on_cpu = types.SimpleNamespace(LayerNormMLP=functools.partial(te.LayerNormMLP, device="cpu"))
    monkeypatch.setattr(ffn, "te", on_cpu, raising=False)
    monkeypatch.setattr(init_fns, "te", te)
    monkeypatch.setitem(catalogue.REGISTRY, (*ffns_with_norm.namespace, "te_ln_mlp"),
                        ffn.build_te_ln_mlp)


def _mpt(ffn_config: dict, norm_type: str = "rmsnorm") -> Any:
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    torch.manual_seed(0)
    return MPTForCausalLM(MPTConfig(**MPT, norm_type=norm_type, ffn_config=dict(ffn_config)))


def _native(te_config: dict | None = None, norm_type: str = "rmsnorm") -> Any:
    """LLM-Foundry's te_ln_mlp MPT, every TE parameter away from its init (a trained
    checkpoint's LayerNorm bias is not zero)."""
    model = _mpt({"ffn_type": "te_ln_mlp", **(te_config or {})}, norm_type)
    with torch.no_grad():
        for block in model.transformer.blocks:
            for p in block.ffn.parameters():
                p.add_(torch.randn_like(p) * 0.5)
    return model


def _target(layout: str, norm_type: str = "rmsnorm") -> Any:
    """This run's MPT: plain without te_swap, plain under te_swap (te.Linear MLP), or fused."""
    model = _mpt({"ffn_type": "mptmlp", "ffn_act_fn": TANH_GELU}, norm_type)
    if layout != "plain":
        apply_swap(model, plan_swap(model, SwapConfig(backend="te",
                                                      fuse_ln_mlp=layout == "fused")))
    return model


def test_llm_foundrys_te_ln_mlp_is_a_layernorm_whatever_the_norm_type(te_ln_mlp):
    """The fact the refusal rests on, at LLM-Foundry's own builder."""
    model = _native()
    block = model.transformer.blocks[0]
    assert isinstance(block.norm_1, torch.nn.RMSNorm) and block.norm_2 is None
    assert block.ffn.normalization == "LayerNorm" and block.ffn.activation == "gelu"
    assert "transformer.blocks.0.ffn.layer_norm_bias" in model.state_dict()
    assert "normalization" not in model.config.ffn_config


@pytest.mark.parametrize("layout", ["plain", "te_swap-plain", "fused"])
@pytest.mark.parametrize("with_config", [True, False], ids=["config", "no-config"])
def test_a_layernorm_te_ln_mlp_into_an_rmsnorm_block_is_refused(te_ln_mlp, layout,
                                                                with_config):
    """Before: loaded (the plain block dropped norm_2.bias as unexpected, the fused one
    ffn.layer_norm_bias). By the config where Composer saved one, else by the keys."""
    native = _native()
    saved = native.state_dict()
    config = dict(native.config.ffn_config) if with_config else None
    with pytest.raises(ValueError) as refused:
        swapped_state_dict(saved, _target(layout), config)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("te_swap: the checkpoint's transformer.blocks.0.ffn is a "
                              "te.LayerNormMLP")
    assert (LAYERNORM_BY_CONFIG if with_config else LAYERNORM_BY_KEYS) in message
    assert "this run's MPT block (RMSNorm norm_2, gelu MLP) cannot compute it" in message


@pytest.mark.parametrize(("te_config", "norm_type", "layout"), [
    ({"normalization": "RMSNorm"}, "rmsnorm", "plain"),
    ({"normalization": "RMSNorm"}, "rmsnorm", "fused"),
    ({}, "layernorm", "plain"),
    ({}, "layernorm", "fused"),
], ids=["rmsnorm-plain", "rmsnorm-fused", "layernorm-plain", "layernorm-fused"])
def test_a_te_ln_mlp_the_block_computes_loads_with_its_logits(te_ln_mlp, te_config, norm_type,
                                                              layout):
    """What the refusal must leave: the native model's own function, strictly loaded."""
    native = _native(te_config, norm_type)
    saved = native.state_dict()
    target = _target(layout, norm_type)
    swapped_state_dict(saved, target, dict(native.config.ffn_config))
    target.load_state_dict(saved, strict=True)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want, got = native(ids).logits, target(ids).logits
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()


def _trainer(folder, model: Any, monkeypatch, swap: dict | None = None,
             load_path: str | None = None) -> Any:
    """A Composer Trainer on `model` (an MPTForCausalLM's config), FSDP2 sharded checkpoints;
    te_swap (`te` backend) with `swap`'s options, None: none."""
    from composer import Trainer
    from composer.utils.parallelism import FSDP2Config
    from llmfoundry.models.mpt import ComposerMPTCausalLM
    from torch.utils.data import DataLoader

    from foundry_fp8 import swap as swap_module
    from foundry_fp8.composer import te_swap
    from foundry_fp8.composer.te_swap import TESwap

    monkeypatch.setattr(te_swap, "_check_te_environment", lambda recipe: None)
    monkeypatch.setattr(swap_module, "would_run_fp8", lambda *args: True)
    torch.manual_seed(0)
    config = model.config.to_dict()
    composer_model = ComposerMPTCausalLM(
        tokenizer=None, loss_fn="torch_crossentropy",
        **{k: config[k] for k in (*MPT, "norm_type", "ffn_config")})
    ids = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(3))
    return Trainer(
        model=composer_model, train_dataloader=DataLoader(
            [{"input_ids": x, "labels": x} for x in ids], batch_size=8),
        max_duration="2ba", algorithms=[] if swap is None else [TESwap(backend="te", **swap)],
        loggers=[], device="cpu",
        parallelism_config={"fsdp": FSDP2Config(state_dict_type="sharded")},
        progress_bar=False, save_folder=str(folder), save_interval="2ba",
        save_overwrite=True, load_path=load_path, load_weights_only=True, seed=17)


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    """The Trainer's model's parameters gathered, by MPT's names (TE's `_extra_state` left
    out: te_swap's models save none)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {_plain_name(k): v.clone()
            for k, v in get_model_state_dict(trainer.state.model, options=full).items()
            if not k.endswith("_extra_state")}


def _sharded_native(tmp_path, monkeypatch, te_config: dict) -> tuple[str, dict]:
    """(LLM-Foundry's te_ln_mlp run's sharded checkpoint, its weights by MPT's names)."""
    saving = _trainer(tmp_path / "native", _native(te_config), monkeypatch)
    saving.fit()
    weights = _weights(saving)
    saving.close()
    assert (tmp_path / "native" / "ep0-ba2" / ".metadata").is_file()
    return str(tmp_path / "native" / "ep0-ba2"), weights


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("layout", ["plain", "fused"])
@pytest.mark.parametrize(("te_config", "refusal"), [
    ({}, LAYERNORM_BY_CONFIG),
    ({"normalization": "RMSNorm", "activation": "relu"}, RELU_BY_CONFIG),
    ({"normalization": "RMSNorm"}, None),
], ids=["layernorm", "relu", "rmsnorm-gelu"])
def test_a_sharded_te_ln_mlp_checkpoint_is_judged_as_a_whole_file(
        tmp_path, one_rank_group, te_ln_mlp, monkeypatch, layout, te_config, refusal):
    """Real Trainers, one gloo rank, FSDP2 on the CPU. Before: the layernorm and relu
    checkpoints loaded into the plain RMSNorm GELU run (renamed by the layout planner) and the
    fused one (the same names; DCP leaves ffn.layer_norm_bias out, and nothing read the
    activation), with no word."""
    one_rank_env(monkeypatch)
    checkpoint, weights = _sharded_native(tmp_path, monkeypatch, te_config)
    swap = {"fuse_ln_mlp": True} if layout == "fused" else {"fuse_ln_mlp": False,
                                                            "exclude": "ffn"}
    resume = functools.partial(_trainer, tmp_path / "resumed", _target("plain"), monkeypatch,
                               swap, checkpoint)
    if refusal is not None:
        with pytest.raises(ValueError) as refused:
            resume()
        message = str(refused.value)
        assert "\n" not in message and refusal in message
        assert message.startswith("te_swap: the checkpoint's model.transformer.blocks.0.ffn is "
                                  "a te.LayerNormMLP")
        return
    resuming = resume()
    loaded = _weights(resuming)
    resuming.close()
    assert sorted(loaded) == sorted(weights)
    for name, value in weights.items():
        assert torch.equal(loaded[name], value), name
