"""LLM-Foundry's `hf_checkpointer` beside te_swap: the HF folder it writes, read back with
transformers' own loader, is the plain MPT the YAML describes, holding the trained weights.

The `te` backend runs on CPU here with the stand-in TE of tests/fake_te.py (TE's parameter names
and `_extra_state`); only the two gates a CPU cannot pass are opened (TE's GPU check and Composer's
`amp_fp8`, which Composer refuses without a GPU). Everything else is LLM-Foundry's real `train`,
its real checkpointer and transformers' `from_pretrained`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from composer.utils import dist

from tests.tiny_run import run_tiny

#: te.LayerNormMLP's parameter names (TE 1.12-2.20 pytorch/module/layernorm_mlp.py,
#: `register_parameter`) and the MPT block parameters they hold (llmfoundry/models/layers/
#: blocks.py `norm_2`, ffn.py `up_proj`/`down_proj`).
TE_TO_MPT = {"ffn.layer_norm_weight": "norm_2.weight", "ffn.layer_norm_bias": "norm_2.bias",
             "ffn.fc1_weight": "ffn.up_proj.weight", "ffn.fc1_bias": "ffn.up_proj.bias",
             "ffn.fc2_weight": "ffn.down_proj.weight", "ffn.fc2_bias": "ffn.down_proj.bias"}


def _te_run(tmp_path: Path, tiny_data, monkeypatch, fake_te):
    from foundry_fp8.composer import te_swap

    fake_te("2.20.2")
    monkeypatch.setattr(te_swap, "_check_te_environment", lambda recipe: None)
    monkeypatch.setattr(te_swap, "would_run_fp8", lambda *args: True)
    return run_tiny(tmp_path, tiny_data, {
        "max_duration": "2ba", "eval_interval": "2ba", "save_interval": "2ba",
        "algorithms": {"te_swap": {"backend": "te", "fuse_ln_mlp": True,
                                   "convert_layernorm": True}},
        # fp8_lint rightly says a CPU fp32 run cannot use the te backend: warned, not failed
        "callbacks": {"fp8_lint": {"fail_on": "never"}, "hf_checkpointer": {"save_folder": str(tmp_path / "hf"),
                                          "save_interval": "2ba", "precision": "float32"}}})


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

    trainer = _te_run(tmp_path, tiny_data, monkeypatch, fake_te)
    trained = {name.removeprefix("model."): p.detach().clone()
               for name, p in trainer.state.model.named_parameters()}
    assert any(name.endswith(".ffn.fc1_weight") for name in trained)  # really fused
    assert any(name.endswith("._extra_state") for name in trainer.state.model.state_dict())
    trainer.close()

    folder = tmp_path / "hf" / "huggingface" / "ba2"
    exported, info = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == ([], [])
    assert type(exported.transformer.blocks[0].ffn.up_proj) is torch.nn.Linear
    params = dict(exported.named_parameters())
    assert sorted(params) == sorted(_plain_name(n) for n in trained)
    for name, value in trained.items():
        assert torch.equal(params[_plain_name(name)], value), name

    # Composer's own checkpoint keeps te_swap's modules (fp8_state and resume need them)
    saved = torch.load(tmp_path / "mpt-tiny-cpu" / "checkpoints" / "ep0-ba2-rank0.pt",
                       map_location="cpu", weights_only=False)["state"]["model"]
    assert any(k.endswith(".ffn.fc1_weight") for k in saved)
    assert any(k.endswith("._extra_state") for k in saved)
    assert dist.get_world_size() == 1


@pytest.mark.filterwarnings("ignore")
def test_without_the_plain_export_the_checkpointer_fails_on_te_keys(
        tmp_path, tiny_data, monkeypatch, fake_te):
    """The failure the export exists for, seen through LLM-Foundry's own checkpointer: its
    strict load into the config's model refuses TE's keys."""
    from foundry_fp8.composer import te_swap

    monkeypatch.setattr(te_swap, "export_plain", lambda callbacks: 0)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict.*_extra_state"):
        _te_run(tmp_path, tiny_data, monkeypatch, fake_te)
