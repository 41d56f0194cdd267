"""The HF folder LLM-Foundry's `hf_checkpointer` writes beside te_swap's `fuse_ln_mlp`, read back
with transformers' own loader, computes the logits the trained Composer model computes (fp32,
outside FP8). The fused te.LayerNormMLP trained with TE's tanh GELU (transformer_engine/common/
util/math.h `gelu`); the plain MPT's default is exact GELU, so before the export named the tanh
GELU in `ffn_config.ffn_act_fn` the two differed by ~1e-3 on the tiny MPT's logits. Stand-in TE
as in tests/test_plain_interop.py."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_plain_interop import _te_run

#: MPT variants as a YAML gives them (the tiny YAML's d_model 64, 4 heads, 2 layers).
VARIANTS = {
    "defaults": {},
    "gqa, split qkv, untied head": {
        "tie_word_embeddings": False,
        "attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 2,
                        "fused_qkv": False}},
}


def _export(tmp_path, tiny_data, monkeypatch, fake_te, overrides, checkpointer="hf_checkpointer",
            trainers=None):
    from transformers import AutoModelForCausalLM

    trainer = _te_run(tmp_path, tiny_data, monkeypatch, fake_te, {
        **overrides, "callbacks": {checkpointer: {
            "save_folder": str(tmp_path / "hf"), "save_interval": "2ba",
            "precision": "float32"}}})
    folder = tmp_path / "hf" / "huggingface" / "ba2"
    exported = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    model = trainer.state.model.eval()
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = model({"input_ids": x, "attention_mask": torch.ones_like(x)}).logits
        read_back = exported(input_ids=x, attention_mask=torch.ones_like(x)).logits
    config = json.loads((folder / "config.json").read_text())
    if trainers is not None:
        trainers.append(trainer)
    return (trained - read_back).abs().max().item(), config["ffn_config"]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_an_all_fused_export_computes_the_trained_logits(tmp_path, tiny_data, monkeypatch,
                                                         fake_te, variant):
    model = {"model": VARIANTS[variant]}
    diff, ffn_config = _export(tmp_path, tiny_data, monkeypatch, fake_te, model)
    assert ffn_config["ffn_act_fn"] == {"name": "gelu", "approximate": "tanh"}
    assert diff < 1e-5  # 9.5e-4 on the defaults before the export named TE's GELU


def _export_warned(tmp_path, tiny_data, monkeypatch, fake_te, plain_warnings, overrides):
    """`_export` and the GELU warnings our export logged."""
    (diff, ffn_config), warned = plain_warnings(
        lambda: _export(tmp_path, tiny_data, monkeypatch, fake_te, overrides))
    return diff, ffn_config, [m for m in warned if "GELU" in m]


@pytest.mark.filterwarnings("ignore")
def test_a_partly_fused_export_keeps_exact_gelu_and_says_so(tmp_path, tiny_data, monkeypatch,
                                                            fake_te, plain_warnings):
    """Block 0 kept (keep_first_blocks: 1) computes exact GELU, block 1 fused the tanh one: MPT's
    config holds one ffn_act_fn for all blocks, so the export stays exact and warns once."""
    diff, ffn_config, warned = _export_warned(tmp_path, tiny_data, monkeypatch, fake_te, plain_warnings, {
        "algorithms": {"te_swap": {"keep_first_blocks": 1}}})
    assert "ffn_act_fn" not in ffn_config
    assert len(warned) == 1 and "all 2 blocks, but 1 of them" in warned[0]
    assert diff > 1e-5  # what the warning is about: block 1's activation differs


@pytest.mark.filterwarnings("ignore")
def test_a_partly_fused_tanh_gelu_mpt_exports_exactly_without_a_warning(
        tmp_path, tiny_data, monkeypatch, fake_te, plain_warnings):
    """The model's own ffn_act_fn is TE's tanh GELU: kept and fused blocks agree."""
    tanh = {"name": "gelu", "approximate": "tanh"}
    diff, ffn_config, warned = _export_warned(tmp_path, tiny_data, monkeypatch, fake_te, plain_warnings, {
        "algorithms": {"te_swap": {"keep_first_blocks": 1}},
        "model": {"ffn_config": {"ffn_act_fn": tanh}}})
    assert (ffn_config["ffn_act_fn"], warned) == (tanh, [])
    assert diff < 1e-5


@pytest.mark.filterwarnings("ignore")
def test_a_checkpointer_returning_the_models_own_config_keeps_it_unchanged(
        tmp_path, tiny_data, monkeypatch, fake_te):
    """A user's HuggingFaceCheckpointer whose `transform_config` returns the trained model's own
    config (LLM-Foundry's returns a deep copy): the export still names TE's GELU, and the trained
    model's config, which Composer's checkpoints save, keeps the GELU it was built with."""
    from llmfoundry.callbacks.hf_checkpointer import HuggingFaceCheckpointer
    from llmfoundry.registry import callbacks

    class OwnConfig(HuggingFaceCheckpointer):
        def transform_config(self, original_config):
            return original_config

    callbacks.register("hf_checkpointer_own_config", func=OwnConfig)
    trainers: list = []
    diff, ffn_config = _export(tmp_path, tiny_data, monkeypatch, fake_te, {},
                               "hf_checkpointer_own_config", trainers)
    assert ffn_config["ffn_act_fn"] == {"name": "gelu", "approximate": "tanh"}
    assert diff < 1e-5
    trained = trainers[0].state.model.model.config.ffn_config
    assert "ffn_act_fn" not in trained  # the tiny YAML's: MPT's default exact GELU
