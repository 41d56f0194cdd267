"""`hf_causal_lm` model sections (FP8046, FP8308) and `master_weights_dtype` in eval configs
(FP8302): what LLM-Foundry's own build_composer_model does with each model section, built the
way train and evaluate_model build it."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.known import HF_CAUSAL_LM_KEYS

BASE = {"max_seq_len": 16, "device_eval_batch_size": 4, "icl_tasks": "tasks.yaml"}
MPT = {"name": "mpt_causal_lm", "d_model": 64, "n_heads": 4, "n_layers": 1, "max_seq_len": 16,
       "vocab_size": 64, "loss_fn": "torch_crossentropy", "attn_config": {"attn_impl": "torch"}}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A local Llama config (no weights: `pretrained: false`), so nothing is downloaded."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=4).save_pretrained(path)
    return str(path)


def _lint(tmp_path: Path, config: dict[str, Any]) -> list[tuple[str, str, str]]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    return [(f["rule"], f["key"], f["severity"]) for f in entry["findings"]]


def _build(name: str, cfg: dict[str, Any], master_weights_dtype: str | None = None) -> Any:
    """LLM-Foundry's own build_composer_model, the call train and evaluate_model make."""
    from llmfoundry.utils.builders import build_composer_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_composer_model(name=name, cfg=cfg, tokenizer=None,
                                    master_weights_dtype=master_weights_dtype)


def test_hf_causal_lm_keys_are_composer_hf_causal_lms_keywords():
    from llmfoundry.models.hf.hf_causal_lm import ComposerHFCausalLM

    parameters = set(inspect.signature(ComposerHFCausalLM.__init__).parameters)
    assert HF_CAUSAL_LM_KEYS == parameters - {"self", "tokenizer"}


@pytest.mark.parametrize(("extra", "refused"), [
    ({}, False),
    ({"master_weights_dtype": "bf16"}, False),  # train pops it
    ({"fc_type": "te"}, True),  # MPT's TE key on a Hugging Face model
    ({"ffn_config": {"ffn_type": "te_ln_mlp"}}, True),
    ({"pretrained_model_name": "x"}, True),  # a misspelling
    ({"loss_fn": "torch_crossentropy"}, True),  # ComposerMPTCausalLM's, not HF's
])
def test_fp8046_is_train_s_own_type_error(tmp_path, tiny_llama, extra, refused):
    """The reference: train pops `name` and `master_weights_dtype` and builds the rest."""
    model = {"name": "hf_causal_lm", "pretrained_model_name_or_path": tiny_llama,
             "pretrained": False, **extra}
    cfg = {k: v for k, v in model.items() if k not in ("name", "master_weights_dtype")}
    try:
        _build("hf_causal_lm", cfg, model.get("master_weights_dtype"))
        raised = False
    except TypeError as error:
        assert "unexpected keyword argument" in str(error)
        raised = True
    found = [(r, k) for r, k, _ in _lint(tmp_path, {"model": model}) if r == "FP8046"]
    assert raised == refused
    assert found == ([("FP8046", f"model.{next(iter(extra))}")] if refused else [])


@pytest.mark.parametrize(("extra", "refused"), [
    ({}, False),
    ({"master_weights_dtype": "bf16"}, True),  # evaluate_model passes it on
    ({"fc_type": "te"}, True),
])
def test_fp8308_is_evaluate_model_s_own_type_error(tmp_path, tiny_llama, extra, refused):
    """The reference: evaluate_model pops `name` alone and builds the rest."""
    model = {"name": "hf_causal_lm", "pretrained_model_name_or_path": tiny_llama,
             "pretrained": False, **extra}
    cfg = {k: v for k, v in model.items() if k != "name"}
    try:
        _build("hf_causal_lm", cfg)
        raised = False
    except TypeError as error:
        assert "unexpected keyword argument" in str(error)
        raised = True
    entry = {"model_name": "m", "model": model, "tokenizer": {"name": "gpt2"}}
    found = [(r, k, s) for r, k, s in _lint(tmp_path, {**BASE, "models": [entry]})
             if r == "FP8308"]
    assert raised == refused
    assert found == ([("FP8308", f"models.0.model.{next(iter(extra))}", "error")]
                     if refused else [])


def test_fp8302_mpt_eval_keeps_master_weights_dtype_unused(tmp_path):
    """In eval, MPTConfig keeps `master_weights_dtype` as an attribute and the parameters stay
    float32; train's own call builds them in bfloat16."""
    import torch

    cfg = {k: v for k, v in {**MPT, "master_weights_dtype": "bf16"}.items() if k != "name"}
    evaluated = _build("mpt_causal_lm", dict(cfg))
    assert {p.dtype for p in evaluated.parameters()} == {torch.float32}
    assert evaluated.model.config.master_weights_dtype == "bf16"
    trained = _build("mpt_causal_lm", {k: v for k, v in cfg.items()
                                       if k != "master_weights_dtype"}, "bf16")
    assert {p.dtype for p in trained.parameters()} == {torch.bfloat16}
    entry = {"model_name": "m", "model": {**MPT, "master_weights_dtype": "bf16"},
             "tokenizer": {"name": "gpt2"}, "load_path": "/c.pt"}
    assert _lint(tmp_path, {**BASE, "models": [entry]}) == [
        ("FP8302", "models.0.model.master_weights_dtype", "warning")]
    # train.py's shape: allow_toplevel_keys moves the same model into `models:`
    assert _lint(tmp_path, {**BASE, **entry}) == [
        ("FP8302", "model.master_weights_dtype", "warning")]
