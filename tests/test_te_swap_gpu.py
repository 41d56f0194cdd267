"""te_swap's TransformerEngine backend on a Hopper GPU (skipped without CUDA; passed on an H200
with TE 2.20.2, 2026-11-26): a real LLM-Foundry run converted to TE trains in FP8 and tracks
BF16, and the recipe TE uses inside the forward is the one the YAML chose."""

from __future__ import annotations

import math

import pytest
import torch
from composer.core import Callback, State
from composer.loggers import Logger

from tests.tiny_run import tiny_config

pytestmark = pytest.mark.gpu

VOCAB = 512  # yamls/mpt-tiny-cpu.yaml
SHORT = {"max_duration": "3ba", "save_interval": "3ba", "eval_interval": "3ba",
         "precision": "amp_fp8"}


class _RecipeProbe(Callback):
    """Reads, inside every TE module's training forward, the recipe TE's global FP8 state holds
    and the module's own amax history length."""

    def __init__(self) -> None:
        self.seen: list[tuple[object, int | None]] = []

    def fit_start(self, state: State, logger: Logger) -> None:
        del logger
        from foundry_fp8.te.probe import active_recipe as active_te_recipe

        def hook(module, args):
            if not module.training:
                return
            meta = module.fp8_meta.get("scaling_fwd")
            history = getattr(meta, "amax_history", None)
            self.seen.append((active_te_recipe(), None if history is None else history.shape[0]))

        for module in state.model.modules():
            if type(module).__module__.startswith("transformer_engine") and hasattr(
                    module, "fp8_meta"):
                module.register_forward_hook(lambda m, a, o: hook(m, a))


def _train(tmp_path, tiny_data, overrides, recipe: dict | None = None, probe: bool = False):
    """`recipe` replaces the YAML's te_swap recipe (None: no te_swap at all). The YAML's
    fp8_stats callback is left out: these runs are about te_swap, not the monitor."""
    from llmfoundry.command_utils import train
    from llmfoundry.registry import callbacks

    pytest.importorskip("transformer_engine.pytorch")
    cfg = tiny_config(tmp_path, tiny_data, overrides)
    del cfg.callbacks["fp8_stats"]
    if recipe is None:
        del cfg.algorithms["te_swap"]
    else:
        cfg.algorithms.te_swap = {"backend": "te", "fp8_recipe": recipe}
    if probe:
        callbacks.register("te_swap_recipe_probe", func=_RecipeProbe)
        cfg.callbacks["te_swap_recipe_probe"] = {}
    trainer = train(cfg)
    found = [c for c in trainer.state.callbacks if isinstance(c, _RecipeProbe)]
    return trainer, (found[0] if found else None)


def test_mpt_swapped_to_te_trains_in_fp8_and_tracks_bf16(tmp_path, tiny_data):
    common = {"max_duration": "40ba", "save_interval": "40ba", "eval_interval": "40ba"}
    bf16, _ = _train(tmp_path / "bf16", tiny_data, {**common, "precision": "amp_bf16"})
    fp8, _ = _train(tmp_path / "fp8", tiny_data, {**common, "precision": "amp_fp8"},
                    recipe={"scaling": "delayed"})
    te_layers = [m for m in fp8.state.model.modules()
                 if type(m).__module__.startswith("transformer_engine")]
    assert len(te_layers) == 8
    assert all(m.fp8_meta["scaling_fwd"].amax_history.abs().sum() > 0 for m in te_layers)
    loss_fp8, loss_bf16 = fp8.state.loss.item(), bf16.state.loss.item()
    assert loss_fp8 < 0.6 * math.log(VOCAB)  # learned well below a uniform guess
    assert abs(loss_fp8 - loss_bf16) < 0.05 * loss_bf16 + 0.05


def test_delayed_recipe_read_back_inside_forward(tmp_path, tiny_data):
    from transformer_engine.common.recipe import DelayedScaling

    trainer, probe = _train(tmp_path, tiny_data, SHORT, probe=True,
                            recipe={"amax_history_len": 7, "amax_compute_algo": "most_recent"})
    assert trainer.state.precision_config["amax_history_len"] == 7
    assert len(probe.seen) == 3 * 8
    for active, history_len in probe.seen:
        assert isinstance(active, DelayedScaling)
        assert (active.amax_history_len, active.amax_compute_algo) == (7, "most_recent")
        assert history_len == 7


def test_current_recipe_is_the_only_one_active_inside_forward(tmp_path, tiny_data):
    from transformer_engine.common.recipe import Float8CurrentScaling

    trainer, probe = _train(tmp_path, tiny_data, SHORT, recipe={"scaling": "current"},
                            probe=True)
    assert trainer.state.precision_config is None  # Composer's default stays outside
    assert len(probe.seen) == 3 * 8
    # nested inside Composer's DelayedScaling autocast, every TE module saw current scaling
    assert {type(active) for active, _ in probe.seen} == {Float8CurrentScaling}
    assert all(history_len is None for _, history_len in probe.seen)
    assert torch.isfinite(trainer.state.loss)


def test_fused_ln_mlp_and_layernorm_swap_keep_the_function_up_to_tanh_gelu():
    te = pytest.importorskip("transformer_engine.pytorch")
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    from foundry_fp8.swap import SwapConfig, apply_swap, plan_swap

    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(d_model=128, n_heads=4, n_layers=2, expansion_ratio=4,
                                     max_seq_len=64, vocab_size=VOCAB,
                                     attn_config={"attn_impl": "torch"})).cuda().eval()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randint(0, VOCAB, (2, 64), device="cuda")
    with torch.no_grad():
        reference = model(batch).logits
    plan = plan_swap(model, SwapConfig(backend="te", fuse_ln_mlp=True, convert_layernorm=True))
    fused = [d for d in plan.converted if d.kind == "ln_mlp"]
    assert len(fused) == 2 and "tanh-approx" in fused[0].reason
    apply_swap(model, plan, optimizers=optimizer)
    ffn = model.transformer.blocks[0].ffn
    assert isinstance(ffn, te.LayerNormMLP) and model.transformer.blocks[0].norm_2 is None
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert params == {id(p) for p in model.parameters()}  # the optimizer follows the swap
    with torch.no_grad():
        swapped = model(batch).logits  # no FP8 autocast: only GELU's tanh form differs
    error = ((swapped - reference).norm() / reference.norm()).item()
    assert 0 < error < 1e-2


def test_real_te_modules_save_and_load_the_plain_mpt_keys():
    """tests/test_plain_interop.py runs LLM-Foundry's checkpointer and loads with the stand-in
    TE; here real TE's modules: their state_dict leaves `_extra_state` out, made plain it loads
    strictly into the unconverted MPT, and the unconverted MPT's loads strictly back into them
    (TE's set_extra_state taking the pickled None put in for the missing key), as does their own
    through torch's full-state-dict loader (tests/test_te220_extra_state.py on the CPU)."""
    pytest.importorskip("transformer_engine.pytorch")
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

    from foundry_fp8.swap import SwapConfig, apply_swap, plain_state_dict, plan_swap

    config = MPTConfig(d_model=128, n_heads=4, n_layers=2, expansion_ratio=4, max_seq_len=64,
                       vocab_size=VOCAB, attn_config={"attn_impl": "torch"})
    model = MPTForCausalLM(config).cuda()
    apply_swap(model, plan_swap(model, SwapConfig(backend="te", fuse_ln_mlp=True,
                                                  convert_layernorm=True)))
    state_dict = model.state_dict()
    assert not any(k.endswith("._extra_state") for k in state_dict)
    assert "transformer.blocks.1.ffn.fc2_weight" in state_dict
    plain = MPTForCausalLM(config).cuda()
    plain.load_state_dict(plain_state_dict(state_dict, model))  # strict
    assert torch.equal(plain.transformer.blocks[1].norm_2.weight,
                       model.transformer.blocks[1].ffn.layer_norm_weight)
    assert torch.equal(plain.transformer.blocks[1].ffn.down_proj.weight,
                       model.transformer.blocks[1].ffn.fc2_weight)
    with torch.no_grad():
        plain.transformer.blocks[0].ffn.up_proj.weight.mul_(2)
    model.load_state_dict(plain.state_dict())  # strict
    assert torch.equal(model.transformer.blocks[0].ffn.fc1_weight,
                       plain.transformer.blocks[0].ffn.up_proj.weight)
    # Composer's loader under FSDP's default full state dict hands TE's modules torch's
    # `_EXTRA_STATE()` placeholder for the keys left out, which TE's set_extra_state refuses
    # ("Unsupported checkpoint format.", module/base.py:1443 in 2.20.2)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    again = MPTForCausalLM(config).cuda()
    apply_swap(again, plan_swap(again, SwapConfig(backend="te", fuse_ln_mlp=True,
                                                  convert_layernorm=True)))
    set_model_state_dict(again, dict(model.state_dict()),
                         options=StateDictOptions(full_state_dict=True, strict=True))
    assert torch.equal(again.transformer.blocks[1].ffn.fc2_weight,
                       model.transformer.blocks[1].ffn.fc2_weight)


def test_generation_inside_composer_s_fp8_autocast_runs_and_training_stays_fp8():
    """Composer's Generate callback: eval mode, torch.no_grad (HF generate), an enabled TE
    autocast (composer/callbacks/generate.py:80, 106). Batch 1 x 1 token per decode step is one
    TE refuses in FP8 (`assert_dim_for_fp8_exec`); te_swap's eval hooks run it in high
    precision, while a training forward (2 x 16 tokens) still runs in FP8."""
    pytest.importorskip("transformer_engine.pytorch")
    import transformers
    from composer.core import Event, Precision
    from composer.core.precision import get_precision_context
    from composer.devices import DeviceGPU

    from foundry_fp8.composer.te_swap import TESwap
    from foundry_fp8.te.probe import active_recipe, is_te_fp8_module

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).cuda()
    state = State(model=model, rank_zero_seed=0, run_name="gen", device=DeviceGPU(),
                  precision=Precision.AMP_FP8)
    TESwap(backend="te").apply(Event.INIT, state, Logger(state))
    fp8: list[bool] = []
    layers = [m for m in model.modules() if is_te_fp8_module(m)]
    assert layers
    for layer in layers:  # after te_swap's hooks: what the layer's own forward sees
        layer.register_forward_pre_hook(lambda m, a: fp8.append(active_recipe() is not None))
    ids = torch.randint(0, VOCAB, (2, 16), device="cuda")
    with get_precision_context(Precision.AMP_FP8, state.precision_config):
        model(ids, labels=ids).loss.backward()
    assert len(fp8) == len(layers) and all(fp8)
    model.eval()
    one = torch.randint(0, VOCAB, (1, 1), device="cuda")
    with torch.no_grad(), get_precision_context(Precision.AMP_FP8, state.precision_config):
        model(one)
        out = model.generate(one, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 4)
    assert len(fp8) > 2 * len(layers) and not any(fp8[len(layers):])
