"""A te_swap model and the plain MPT its config describes, both ways: LLM-Foundry's
`hf_checkpointer` beside te_swap writes an HF folder that, read back with transformers' own
loader, is the plain MPT holding the trained weights; and a plain Composer checkpoint loaded into
a te_swap run (`load_path`) reaches the converted and fused layers.

The `te` backend runs on CPU here with the stand-in TE of tests/fake_te.py (TE's parameter names
and `_extra_state`); only the two gates a CPU cannot pass are opened (TE's GPU check and Composer's
`amp_fp8`, which Composer refuses without a GPU). Everything else is LLM-Foundry's real `train`,
its real checkpointer and transformers' `from_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from composer.utils import dist
from omegaconf import OmegaConf as om

from foundry_fp8.te.probe import te_class_name
from tests.ranks import run_ranks
from tests.tiny_run import run_folder, run_plain, run_tiny

#: te.LayerNormMLP's parameter names (TE 1.12-2.20 pytorch/module/layernorm_mlp.py,
#: `register_parameter`) and the MPT block parameters they hold (llmfoundry/models/layers/
#: blocks.py `norm_2`, ffn.py `up_proj`/`down_proj`).
TE_TO_MPT = {"ffn.layer_norm_weight": "norm_2.weight", "ffn.layer_norm_bias": "norm_2.bias",
             "ffn.fc1_weight": "ffn.up_proj.weight", "ffn.fc1_bias": "ffn.up_proj.bias",
             "ffn.fc2_weight": "ffn.down_proj.weight", "ffn.fc2_bias": "ffn.down_proj.bias"}


def _te_run(tmp_path: Path, tiny_data, monkeypatch, fake_te, overrides: dict[str, Any]):
    from foundry_fp8 import swap
    from foundry_fp8.composer import te_swap

    fake_te("2.20.2")
    monkeypatch.setattr(te_swap, "_check_te_environment", lambda recipe: None)
    monkeypatch.setattr(swap, "would_run_fp8", lambda *args: True)
    return run_tiny(tmp_path, tiny_data, om.to_container(om.merge({
        "max_duration": "2ba", "eval_interval": "2ba", "save_interval": "2ba",
        "algorithms": {"te_swap": {"backend": "te", "fuse_ln_mlp": True,
                                   "convert_layernorm": True}},
        # fp8_lint rightly says a CPU fp32 run cannot use the te backend: warned, not failed
        "callbacks": {"fp8_lint": {"fail_on": "never"}}}, overrides)))


def _hf_run(tmp_path: Path, tiny_data, monkeypatch, fake_te):
    return _te_run(tmp_path, tiny_data, monkeypatch, fake_te, {"callbacks": {"hf_checkpointer": {
        "save_folder": str(tmp_path / "hf"), "save_interval": "2ba", "precision": "float32"}}})


def _plain_name(name: str) -> str:
    """The unconverted MPT's name of a te_swap model's parameter (by TE_TO_MPT)."""
    for fused, plain in TE_TO_MPT.items():
        if name.endswith(f".{fused}"):
            return name.removesuffix(fused) + plain
    return name


@pytest.mark.filterwarnings("ignore")
def test_hf_checkpointer_exports_the_plain_mpt_with_the_trained_weights(
        tmp_path, tiny_data, monkeypatch, fake_te):
    from transformers import AutoModelForCausalLM

    trainer = _hf_run(tmp_path, tiny_data, monkeypatch, fake_te)
    trained = {name.removeprefix("model."): p.detach().clone()
               for name, p in trainer.state.model.named_parameters()}
    assert any(name.endswith(".ffn.fc1_weight") for name in trained)  # really fused
    assert any(hasattr(m, "get_extra_state") and type(m).__module__.startswith("transformer_")
               for m in trainer.state.model.modules())

    folder = tmp_path / "hf" / "huggingface" / "ba2"
    exported, info = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == ([], [])
    assert type(exported.transformer.blocks[0].ffn.up_proj) is torch.nn.Linear
    params = dict(exported.named_parameters())
    assert sorted(params) == sorted(_plain_name(n) for n in trained)
    for name, value in trained.items():
        assert torch.equal(params[_plain_name(name)], value), name

    # Composer's own checkpoint keeps the fused names (a resume needs them; torch's
    # get_model_state_dict looks each key up as a module path) and leaves TE's _extra_state out
    saved = torch.load(tmp_path / "mpt-tiny-cpu" / "checkpoints" / "ep0-ba2-rank0.pt",
                       map_location="cpu", weights_only=False)["state"]["model"]
    assert any(k.endswith(".ffn.fc1_weight") for k in saved)
    assert not any(k.endswith("._extra_state") for k in saved)
    assert dist.get_world_size() == 1


@pytest.mark.filterwarnings("ignore")
def test_without_the_plain_export_the_checkpointer_fails_on_te_keys(
        tmp_path, tiny_data, monkeypatch, fake_te):
    """The failure the export exists for, seen through LLM-Foundry's own checkpointer: its
    strict load into the config's model refuses TE's keys."""
    from foundry_fp8.composer import te_swap

    monkeypatch.setattr(te_swap, "export_plain", lambda callbacks: 0)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict.*ffn\.fc1_weight"):
        _hf_run(tmp_path, tiny_data, monkeypatch, fake_te)


def _plain_checkpoint(tmp_path: Path, tiny_data) -> tuple[Path, dict[str, torch.Tensor]]:
    """One batch of the tiny YAML without te_swap, seeded unlike the te_swap run: its Composer
    checkpoint and weights."""
    trainer = run_plain(tmp_path / "plain", tiny_data, {  # another seed: another init
        "seed": 5, "max_duration": "1ba", "eval_interval": "1ba", "save_interval": "1ba"})
    weights = {n.removeprefix("model."): p.detach().clone()
               for n, p in trainer.state.model.named_parameters()}
    return run_folder(tmp_path / "plain") / "checkpoints" / "ep0-ba1-rank0.pt", weights


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("strict", [False, True])
def test_a_plain_checkpoint_loads_into_the_converted_and_fused_layers(
        tmp_path, tiny_data, monkeypatch, fake_te, strict):
    """Composer loads non-strictly by default: a fused block's MLP used to keep its fresh init,
    with only a log line; strictly, the load failed on the keys. At lr 0, the weights after a
    batch are the loaded ones."""
    checkpoint, plain = _plain_checkpoint(tmp_path, tiny_data)
    trainer = _te_run(tmp_path, tiny_data, monkeypatch, fake_te, {
        "load_path": str(checkpoint), "load_weights_only": True,
        "load_strict_model_weights": strict, "optimizer": {"lr": 0.0},
        "max_duration": "1ba", "save_interval": "1ba", "eval_interval": "1ba"})
    loaded = {name.removeprefix("model."): p.detach()
              for name, p in trainer.state.model.named_parameters()}
    assert any(name.endswith(".ffn.fc1_weight") for name in loaded)  # really fused
    assert sorted(_plain_name(n) for n in loaded) == sorted(plain)
    for name, value in loaded.items():
        assert torch.equal(value, plain[_plain_name(name)]), name


@pytest.mark.filterwarnings("ignore")
def test_a_te_swap_checkpoint_loads_strictly_into_a_run_without_te_swap(
        tmp_path, tiny_data, monkeypatch, fake_te):
    """TE's `_extra_state` keys made a `te` backend checkpoint unloadable by a plain run with a
    strict load (LLM-Foundry's `evaluate` always loads strictly): they are left out now."""
    trainer = _te_run(tmp_path, tiny_data, monkeypatch, fake_te, {"algorithms": {"te_swap": {
        "fuse_ln_mlp": False}}})
    trained = {n.removeprefix("model."): p.detach().clone()
               for n, p in trainer.state.model.named_parameters()}
    assert sum(te_class_name(m) == "Linear" for m in trainer.state.model.modules()) == 8
    plain = run_plain(tmp_path / "plain", tiny_data, {
        "load_path": str(run_folder(tmp_path) / "checkpoints" / "ep0-ba2-rank0.pt"),
        "load_weights_only": True, "load_strict_model_weights": True,
        "optimizer": {"lr": 0.0}, "max_duration": "1ba", "eval_interval": "1ba",
        "save_interval": "1ba"})
    loaded = {n.removeprefix("model."): p.detach()
              for n, p in plain.state.model.named_parameters()}
    assert loaded.keys() == trained.keys()
    for name, value in loaded.items():
        assert torch.equal(value, trained[name]), name


def _full_load_worker(rank: int, rendezvous: str, out_dir: str) -> None:
    """A plain MPT's state dict loaded into a fused te_swap MPT with torch's
    `set_model_state_dict(full_state_dict=True)`, the loader Composer uses under FSDP's default
    full state dict: as given, and after `swapped_state_dict`."""
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from foundry_fp8.swap import SwapConfig, apply_swap, plan_swap, swapped_state_dict
    from tests.fake_te import install_fake_te
    from tests.ranks import init_rank

    init_rank(rank, rendezvous)
    install_fake_te(pytest.MonkeyPatch())
    config = MPTConfig(d_model=64, n_heads=4, n_layers=2, expansion_ratio=4, max_seq_len=64,
                       vocab_size=512, attn_config={"attn_impl": "torch"})
    torch.manual_seed(5)
    plain = MPTForCausalLM(config).state_dict()
    results = {}
    for renamed in (False, True):
        torch.manual_seed(17)
        model = MPTForCausalLM(config)
        apply_swap(model, plan_swap(model, SwapConfig(backend="te", fuse_ln_mlp=True)))
        given = {k: v.clone() for k, v in plain.items()}
        if renamed:
            swapped_state_dict(given, model)
        set_model_state_dict(model, given, options=StateDictOptions(full_state_dict=True,
                                                                    strict=renamed))
        results[renamed] = torch.equal(model.transformer.blocks[1].ffn.fc1_weight,
                                       plain["transformer.blocks.1.ffn.up_proj.weight"])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {str(k): v for k, v in results.items()}))


def test_a_full_state_dict_load_reaches_the_fused_layers_once_renamed(tmp_path):
    """torch keeps only the model's own keys before any load hook runs, so the pre-hook alone
    cannot help there (a fused MLP kept its init); `swapped_state_dict`, which te_swap applies
    to every Composer load, renames the plain keys first."""
    run_ranks(_full_load_worker, str(tmp_path))
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {
            "False": False, "True": True}
