"""te_swap on LLM-Foundry's real MPT: the plan, exact conversion, and a real training run with
the emulated backend whose FP8 state follows the YAML's recipe."""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.emulate import EmulatedFP8Linear
from foundry_fp8.recipe import RecipeError
from foundry_fp8.swap import SwapConfig, apply_swap, fp8_share, plan_swap
from tests.tiny_run import run_tiny, tiny_config


def _mpt(d_model: int = 64, ffn_type: str = "mptmlp", no_bias: bool = True, n_layers: int = 3):
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    torch.manual_seed(0)
    return MPTForCausalLM(MPTConfig(d_model=d_model, n_heads=4, n_layers=n_layers,
                                    expansion_ratio=4, max_seq_len=32, vocab_size=128,
                                    no_bias=no_bias, attn_config={"attn_impl": "torch"},
                                    ffn_config={"ffn_type": ffn_type}))


@pytest.mark.parametrize("ffn_type", ["mptmlp", "mptglu"])
@pytest.mark.parametrize("no_bias", [True, False])
def test_plan_and_exact_conversion_on_real_mpt(ffn_type, no_bias):
    model = _mpt(ffn_type=ffn_type, no_bias=no_bias)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fused = model.transformer.blocks[0].attn.Wqkv._fused
    plan = plan_swap(model, SwapConfig(backend="emulate", keep_last_blocks=1))
    converted = {d.name for d in plan if d.convert}
    per_block = 4 if ffn_type == "mptmlp" else 5  # Wqkv, out_proj, up, (gate,) down
    assert len(converted) == 2 * per_block
    assert not any(".blocks.2." in n for n in converted)
    apply_swap(model, plan, "emulate")
    modules = dict(model.named_modules())
    assert all(isinstance(modules[n], EmulatedFP8Linear) for n in converted)
    assert modules["transformer.blocks.0.attn.Wqkv"]._fused == fused  # LLM-Foundry init needs it
    after = model.state_dict()
    assert after.keys() == before.keys()  # parameter names stable
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit-exact copy
    # hand count: attention 4*d^2, MLP 2*4*d^2 (+ gate 4*d^2 for GLU) per block, 3 blocks
    d = 64
    per_block_params = 4 * d * d + (12 if ffn_type == "mptglu" else 8) * d * d
    assert fp8_share(plan) == pytest.approx(2 / 3)
    assert sum(dd.params for dd in plan) == 3 * per_block_params


def test_odd_dims_are_kept_with_the_reason():
    plan = plan_swap(_mpt(d_model=72, n_layers=1), SwapConfig(backend="emulate"))
    assert plan and not any(d.convert for d in plan)  # 72 % 16 != 0 for every block GEMM
    assert all("divisible by 16" in d.reason or "outside" in d.reason for d in plan)


def test_bad_options_fail_with_the_key():
    from foundry_fp8.composer.te_swap import TESwap

    with pytest.raises(RecipeError, match=r"fp8_recipe\.fp8_format"):
        TESwap(backend="emulate", fp8_recipe={"fp8_format": "E5M2"})
    with pytest.raises(ValueError, match="te_swap.backend"):
        TESwap(backend="fp8")


def test_te_backend_without_te_names_emulate():
    from foundry_fp8.composer.te_swap import TESwap
    from foundry_fp8.te_backend import te_available

    if te_available():
        pytest.skip("TransformerEngine is installed here")
    with pytest.raises(RuntimeError, match="backend: emulate"):
        TESwap()


@pytest.mark.slow
def test_real_run_follows_the_recipe_and_trains_converted_weights(tmp_path, tiny_data):
    recipe = {"amax_history_len": 4, "amax_compute_algo": "most_recent"}
    trainer = run_tiny(tmp_path, tiny_data, {
        "max_duration": "6ba", "save_interval": "6ba",
        "algorithms": {"te_swap": {"backend": "emulate", "fp8_recipe": recipe}}})
    layers = [m for m in trainer.state.model.modules() if isinstance(m, EmulatedFP8Linear)]
    assert len(layers) == 8  # 2 blocks x (Wqkv, out_proj, up_proj, down_proj)
    optimizer = trainer.state.optimizers[0]
    for layer in layers:
        # the optimizer holds the converted parameters and has stepped them
        assert any(p is layer.weight for g in optimizer.param_groups for p in g["params"])
        assert optimizer.state[layer.weight]["exp_avg"].abs().sum() > 0
        for which, fmt_max in (("scaling_fwd", 448.0), ("scaling_bwd", 57344.0)):
            meta = layer.fp8_meta[which]
            assert meta.amax_history.shape[0] == 4
            # most_recent: the scale in force is fp8_max / the newest amax (rolled to the end)
            newest = meta.amax_history[-1, 0]
            assert newest > 0
            assert meta.scale[0].item() == pytest.approx(fmt_max / newest.item(), rel=1e-6)


@pytest.mark.slow
def test_real_run_with_current_scaling_keeps_no_history(tmp_path, tiny_data):
    from llmfoundry.command_utils import train

    cfg = tiny_config(tmp_path, tiny_data, {"max_duration": "3ba", "save_interval": "3ba",
                                            "eval_interval": "3ba"})
    # replace (not merge) the YAML's delayed recipe: fp8_lint rejects history keys with current
    cfg.algorithms.te_swap.fp8_recipe = {"scaling": "current"}
    trainer = train(cfg)
    layers = [m for m in trainer.state.model.modules() if isinstance(m, EmulatedFP8Linear)]
    assert len(layers) == 8
    for layer in layers:
        for which in ("scaling_fwd", "scaling_bwd"):
            meta = layer.fp8_meta[which]
            assert meta.amax_history.abs().sum() == 0 and torch.all(meta.scale == 1)
