"""FP8062/FP8063: `foundry-fp8 lint` reads an `hf_causal_lm`'s config.json where it is on this
machine (a folder, or the Hugging Face cache) and predicts te_swap's plan for it. Checked
against transformers' own config loading (AutoConfig, LLM-Foundry's set_config_overrides) and
te_swap's own plan (convert_to_fp8, backend emulate) on the model built from that config.
Before, a GPT-2 linted clean and the run stopped at INIT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import yaml
from llmfoundry.utils.config_utils import set_config_overrides

from foundry_fp8 import SwapConfig, convert_to_fp8
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.rules.hf import LLAMA_LAYOUT, HFConfig, hub_cache, llama_dims

EMULATE = {"backend": "emulate"}
OURS = ("FP8062", "FP8063")


def _gpt2(folder: Path) -> Path:
    transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64).save_pretrained(folder)
    return folder


def _llama(folder: Path, **kwargs: Any) -> Path:
    dims = {"hidden_size": 64, "intermediate_size": 40, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
            "max_position_embeddings": 64, **kwargs}
    transformers.LlamaConfig(**dims).save_pretrained(folder)
    return folder


def _lint(tmp_path: Path, name: str, overrides: dict | None = None,
          swap: dict | None = None, extra: dict | None = None
          ) -> tuple[list[dict], list[str]]:
    """Our rules' findings for an hf_causal_lm train config, and the file's lines."""
    model: dict[str, Any] = {"name": "hf_causal_lm", "pretrained_model_name_or_path": name,
                             "pretrained": False, **(extra or {})}
    if overrides:
        model["config_overrides"] = overrides
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"precision": "amp_bf16", "model": model,
                                    "algorithms": {"te_swap": swap or EMULATE}},
                                   sort_keys=False))
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    return [f for f in entry["findings"] if f["rule"] in OURS], path.read_text().splitlines()


def _at(finding: dict, lines: list[str], leaf: str) -> None:
    assert lines[finding["line"] - 1][finding["column"] - 1:].startswith(f"{leaf}:")


def _plan(folder: Path | str, overrides: dict | None = None, **options: Any):
    """te_swap's own plan on the model LLM-Foundry builds: AutoConfig, its overrides, the
    model from that config (hf_base.py build_inner_model)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    set_config_overrides(config, overrides or {})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return convert_to_fp8(model, SwapConfig(backend="emulate", **options), precision="amp_bf16")


def test_gpt2_conv1d_is_te_swaps_refusal(tmp_path):
    folder = _gpt2(tmp_path / "gpt2")
    found, lines = _lint(tmp_path, str(folder))
    assert [f["rule"] for f in found] == ["FP8062"] and found[0]["severity"] == "error"
    assert found[0]["key"] == "model.pretrained_model_name_or_path"
    _at(found[0], lines, "pretrained_model_name_or_path")
    assert "8 block linears as transformers' Conv1D" in found[0]["message"]
    assert "tied" in found[0]["message"] and str(folder / "config.json") in found[0]["message"]
    with pytest.raises(ValueError, match="no module would run in FP8.*Conv1D"):
        _plan(folder)


def test_gpt2_untied_head_by_overrides(tmp_path):
    """config_overrides untie the head: with a vocab of 16s and keep_lm_head false te_swap
    converts it (quiet); with GPT-2's 50257 it keeps it (FP8062 at the override's line)."""
    folder = _gpt2(tmp_path / "gpt2")
    untied = {"tie_word_embeddings": False, "vocab_size": 50304}
    found, _ = _lint(tmp_path, str(folder), untied, {**EMULATE, "keep_lm_head": False})
    assert found == []
    plan = _plan(folder, untied, keep_lm_head=False)
    assert [d.name for d in plan.converted] == ["lm_head"]
    odd = {"tie_word_embeddings": False}
    found, lines = _lint(tmp_path, str(folder), odd, {**EMULATE, "keep_lm_head": False})
    assert [f["key"] for f in found] == ["model.config_overrides.tie_word_embeddings"]
    _at(found[0], lines, "tie_word_embeddings")
    assert "breaks TE's FP8 rule" in found[0]["message"]
    with pytest.raises(ValueError, match="no module would run in FP8"):
        _plan(folder, odd, keep_lm_head=False)


def test_embedding_resizing_leaves_the_head_unjudged(tmp_path):
    """allow_embedding_resizing: Composer's HuggingFaceModel grows the embeddings to the
    tokenizer's length (_check_tokenizer_and_maybe_resize_embeddings), unknown to the linter."""
    untied = ({"tie_word_embeddings": False}, {**EMULATE, "keep_lm_head": False})
    gpt2, llama = str(_gpt2(tmp_path / "gpt2")), str(_llama(tmp_path / "l", intermediate_size=48))
    assert [f["rule"] for f in _lint(tmp_path, gpt2, *untied)[0]] == ["FP8062"]
    assert [f["rule"] for f in _lint(tmp_path, llama, *untied)[0]] == ["FP8063"]
    resized = {"allow_embedding_resizing": True}
    assert _lint(tmp_path, gpt2, *untied, resized)[0] == []
    assert _lint(tmp_path, llama, *untied, resized)[0] == []


def test_llama_intermediate_size_off_is_a_warning_te_swap_agrees(tmp_path):
    folder = _llama(tmp_path / "llama")
    found, lines = _lint(tmp_path, str(folder))
    assert [(f["rule"], f["severity"], f["key"]) for f in found] == [
        ("FP8063", "warning", "model.pretrained_model_name_or_path")]
    assert "intermediate_size 40" in found[0]["message"]
    kept = {d.name.rsplit(".", 1)[-1] for d in _plan(folder).decisions
            if not d.convert and "breaks TE's FP8 rule" in str(d.reason)}
    assert kept == {"gate_proj", "up_proj", "down_proj"}
    # the override fixes it, named where it stands when it breaks it again
    assert _lint(tmp_path, str(folder), {"intermediate_size": 48})[0] == []
    assert all(d.convert for d in _plan(folder, {"intermediate_size": 48}).decisions
               if d.name.startswith("model.layers."))
    heads = {"head_dim": 8, "num_key_value_heads": 1}  # k/v_proj out 1 x 8, q_proj's 4 x 8
    found, lines = _lint(tmp_path, str(_llama(tmp_path / "ok", intermediate_size=48)), heads)
    assert [f["key"] for f in found] == ["model.config_overrides.head_dim"]
    assert "num_key_value_heads x head_dim 8 " in found[0]["message"]
    _at(found[0], lines, "head_dim")
    kept = {d.name.rsplit(".", 1)[-1] for d in _plan(tmp_path / "ok", heads).decisions
            if not d.convert and "breaks TE's FP8 rule" in str(d.reason)}
    assert kept == {"k_proj", "v_proj"}


def test_llama_hidden_size_override_off_is_te_swaps_refusal(tmp_path):
    folder = _llama(tmp_path / "llama", intermediate_size=48)
    found, lines = _lint(tmp_path, str(folder), {"hidden_size": 72})
    assert [(f["rule"], f["key"]) for f in found] == [
        ("FP8062", "model.config_overrides.hidden_size")]
    _at(found[0], lines, "hidden_size")
    with pytest.raises(ValueError, match="no module would run in FP8"):
        _plan(folder, {"hidden_size": 72})


@pytest.mark.parametrize("model_type", sorted(LLAMA_LAYOUT))
def test_llama_layout_dims_are_transformers(tmp_path, model_type):
    """A config.json with only the main keys: the class defaults the linter fills in are the
    ones transformers builds the model with (q/k_proj's out, the MLP's, the tied head)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": model_type, "hidden_size": 256, "num_attention_heads": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 96}))
    dims = llama_dims(HFConfig(tmp_path / "config.json",
                               json.loads((tmp_path / "config.json").read_text()), {}))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0]
    assert dims is not None
    assert (dims.hidden, dims.q_width, dims.kv_width, dims.intermediate, dims.vocab, dims.tied) \
        == (256, layer.self_attn.q_proj.out_features, layer.self_attn.k_proj.out_features,
            layer.mlp.gate_proj.out_features, model.lm_head.out_features,
            model.lm_head.weight is model.model.embed_tokens.weight)


def _cache(root: Path, name: str, folder: Path, ref: bool = True) -> None:
    """The hub cache's layout (huggingface_hub file_download.py): models--ORG--NAME,
    refs/main holding the commit, snapshots/<commit>/config.json."""
    repo = root / f"models--{name.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_bytes((folder / "config.json").read_bytes())
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)


def test_hub_name_in_the_cache(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    _cache(hub, "acme/tiny-gpt2", _gpt2(tmp_path / "gpt2"))
    _cache(hub, "acme/no-ref", tmp_path / "gpt2", ref=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    # transformers resolves the same name to the same config offline
    config = transformers.AutoConfig.from_pretrained("acme/tiny-gpt2", cache_dir=hub,
                                                     local_files_only=True)
    assert config.model_type == "gpt2"
    found, _ = _lint(tmp_path, "acme/tiny-gpt2")
    assert [f["rule"] for f in found] == ["FP8062"]
    assert _lint(tmp_path, "acme/no-ref")[0] == []  # no refs/main: not judged
    assert _lint(tmp_path, "acme/not-here")[0] == []  # not downloaded: not judged


@pytest.mark.parametrize("env", [
    {"HF_HUB_CACHE": "/x/hub"}, {"HF_HOME": "/x/home"}, {"XDG_CACHE_HOME": "/x/xdg"},
    {"HUGGINGFACE_HUB_CACHE": "/x/old", "HF_HOME": "/x/home"}, {}])
def test_hub_cache_is_huggingface_hubs(env):
    keys = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")
    environ = {k: v for k, v in os.environ.items() if k not in keys} | env
    theirs = subprocess.run(
        [sys.executable, "-c", "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"],
        capture_output=True, text=True, env=environ, check=True).stdout.strip()
    assert hub_cache(environ) == Path(theirs)
