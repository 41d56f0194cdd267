"""FP8062/FP8063 on the Hugging Face layouts users fine-tune beyond Llama: Falcon (fused
query_key_value in its three layouts), Phi-3 (fused qkv_proj and gate_up_proj), Mixtral and
Qwen's MoE (experts and routers te_swap keeps whatever their dims), GPT-NeoX (head embed_out).
Before, the linter judged only the Llama layout and GPT-2: every config here linted clean. The
reference is te_swap's own plan (convert_to_fp8, backend emulate) on the model transformers
builds from the same config.json with LLM-Foundry's set_config_overrides, as hf_base.py does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import yaml
from llmfoundry.utils.config_utils import set_config_overrides

from foundry_fp8 import SwapConfig, convert_to_fp8
from foundry_fp8.lint.cli import lint_file

OURS = ("FP8062", "FP8063")
def _moe(name: str) -> bool:
    """A linear te_swap keeps as an MoE expert or router, or with one output (Qwen2-MoE's
    shared_expert_gate): kept whatever the config's dims, so no finding names it."""
    return ".experts." in name or name.endswith((".gate", ".shared_expert_gate"))


def _write(folder: Path, values: dict[str, Any]) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(values))
    return folder


def _lint(tmp_path: Path, folder: Path, overrides: dict | None = None,
          swap: dict | None = None) -> list[dict]:
    model: dict[str, Any] = {"name": "hf_causal_lm", "pretrained_model_name_or_path": str(folder),
                             "pretrained": False}
    if overrides:
        model["config_overrides"] = overrides
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"precision": "amp_bf16", "model": model, "algorithms": {
        "te_swap": {"backend": "emulate", **(swap or {})}}}, sort_keys=False))
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    return [f for f in entry["findings"] if f["rule"] in OURS]


def _plan(folder: Path, overrides: dict | None = None, **options: Any):
    """te_swap's plan on the model LLM-Foundry builds (hf_base.py build_config, build_inner_model)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    set_config_overrides(config, overrides or {})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return convert_to_fp8(model, SwapConfig(backend="emulate", **options), precision="amp_bf16")


def _kept_by_shape(plan) -> set[str]:
    """The block linears te_swap keeps for their dims, by name without the layer number."""
    return {".".join(p for p in d.name.split(".") if not p.isdigit()).split("layers.", 1)[-1]
            .split("h.", 1)[-1] for d in plan.decisions
            if not d.convert and "breaks TE's FP8 rule" in d.reason
            and not _moe(d.name) and "." in d.name}


#: (config.json, config_overrides, te_swap's kept block linears, FP8063's "what size" each)
CASES: dict[str, tuple[dict, dict | None, set[str], list[str]]] = {
    "falcon new_decoder_architecture": (
        {"model_type": "falcon", "hidden_size": 80, "num_attention_heads": 8, "num_kv_heads": 1,
         "new_decoder_architecture": True, "num_hidden_layers": 2, "vocab_size": 1024},
        None, {"self_attention.query_key_value"},
        ["(2 x num_kv_heads + num_attention_heads) x head_dim 100"]),
    "falcon multi_query (its default)": (
        {"model_type": "falcon", "hidden_size": 80, "num_attention_heads": 8,
         "num_hidden_layers": 2, "vocab_size": 1024},
        None, {"self_attention.query_key_value"}, ["hidden_size + 2 x head_dim (multi_query) 100"]),
    "falcon ffn_hidden_size from config.json's hidden_size": (
        # FalconConfig sets ffn_hidden_size = 4 x hidden_size at __init__: the override after it
        # leaves 4 x 66 = 264
        {"model_type": "falcon", "hidden_size": 66, "num_attention_heads": 2, "multi_query": False,
         "num_hidden_layers": 2, "vocab_size": 1024},
        {"hidden_size": 64}, {"mlp.dense_h_to_4h", "mlp.dense_4h_to_h"}, ["ffn_hidden_size 264"]),
    "phi3 fused gate_up fits, down_proj does not": (
        {"model_type": "phi3", "hidden_size": 64, "intermediate_size": 40,
         "num_attention_heads": 4, "num_key_value_heads": 1, "num_hidden_layers": 2,
         "vocab_size": 1024, "pad_token_id": 0},
        None, {"mlp.down_proj"}, ["intermediate_size 40"]),
    "phi3 fused qkv_proj": (
        {"model_type": "phi3", "hidden_size": 80, "intermediate_size": 48,
         "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "vocab_size": 1024, "pad_token_id": 0},
        None, {"self_attn.qkv_proj"},
        ["(num_attention_heads + 2 x num_key_value_heads) x head_dim 120"]),
    "mixtral: experts off are te_swap's anyway": (
        {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 40, "head_dim": 12,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
         "num_hidden_layers": 2, "vocab_size": 1024},
        None, {"self_attn.k_proj", "self_attn.v_proj"}, ["num_key_value_heads x head_dim 24"]),
    "qwen2_moe shared expert and a dense layer": (
        {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 40,
         "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40, "head_dim": 12,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
         "num_experts_per_tok": 2, "mlp_only_layers": [1], "num_hidden_layers": 2,
         "vocab_size": 1024},
        None, {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.shared_expert.gate_proj",
               "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"},
        ["intermediate_size 40", "shared_expert_intermediate_size 40"]),
    "qwen3_moe head_dim": (
        {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 40,
         "moe_intermediate_size": 24, "head_dim": 12, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
         "num_hidden_layers": 2, "vocab_size": 1024},
        None, {"self_attn.k_proj", "self_attn.v_proj"}, ["num_key_value_heads x head_dim 24"]),
    "gpt_neox intermediate_size": (
        {"model_type": "gpt_neox", "hidden_size": 64, "intermediate_size": 40,
         "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 1024},
        None, {"mlp.dense_h_to_4h", "mlp.dense_4h_to_h"}, ["intermediate_size 40"]),
    "llama head_dim from config.json's hidden_size": (
        # LlamaConfig derives head_dim (72 / 4) and num_key_value_heads at __init__
        {"model_type": "llama", "hidden_size": 72, "intermediate_size": 48,
         "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 1024},
        {"hidden_size": 64}, {"self_attn.q_proj", "self_attn.o_proj", "self_attn.k_proj",
                              "self_attn.v_proj"},
        ["num_attention_heads x head_dim 72", "num_key_value_heads x head_dim 72"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8063_names_the_layers_te_swap_keeps(tmp_path, case):
    values, overrides, kept, said = CASES[case]
    folder = _write(tmp_path / "model", values)
    assert _kept_by_shape(_plan(folder, overrides)) == kept
    found = _lint(tmp_path, folder, overrides)
    assert [f["rule"] for f in found] == ["FP8063"] * len(said)
    assert [f["message"].split(f"{values['model_type']} ", 1)[1].split(" is not")[0]
            for f in found] == said


def test_qwen2_moe_ignores_head_dim_mixtral_takes_it(tmp_path):
    """Qwen2-MoE's attention takes hidden_size // num_attention_heads whatever head_dim says
    (modeling_qwen2_moe.py:290); Mixtral's takes head_dim."""
    qwen = _write(tmp_path / "qwen", {**CASES["qwen2_moe shared expert and a dense layer"][0],
                                      "intermediate_size": 48, "shared_expert_intermediate_size": 48})
    assert _kept_by_shape(_plan(qwen)) == set()
    assert _lint(tmp_path, qwen) == []


def test_an_untied_embed_out_is_named(tmp_path):
    folder = _write(tmp_path / "neox", {"model_type": "gpt_neox", "hidden_size": 64,
                                        "intermediate_size": 48, "num_attention_heads": 4,
                                        "num_hidden_layers": 2, "vocab_size": 1000})
    plan = _plan(folder, keep_lm_head=False)
    assert [d.name for d in plan.decisions if not d.convert] == ["embed_out"]
    found = _lint(tmp_path, folder, swap={"keep_lm_head": False})
    assert [f["rule"] for f in found] == ["FP8063"]
    assert "vocab_size 1000" in found[0]["message"] and "(embed_out)" in found[0]["message"]


@pytest.mark.parametrize(("values", "key"), [
    ({"model_type": "mixtral", "hidden_size": 72, "num_attention_heads": 4,
      "num_key_value_heads": 2, "num_local_experts": 4, "num_hidden_layers": 2,
      "vocab_size": 1024}, "model.pretrained_model_name_or_path"),
    # every planned linear off, the head kept (keep_lm_head): nothing left
    ({"model_type": "mixtral", "hidden_size": 64, "head_dim": 10, "num_attention_heads": 4,
      "num_key_value_heads": 2, "num_local_experts": 4, "num_hidden_layers": 2,
      "vocab_size": 1024}, "model.pretrained_model_name_or_path"),
    ({"model_type": "falcon", "hidden_size": 40, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 1024}, "model.pretrained_model_name_or_path"),
])
def test_fp8062_where_te_swap_refuses(tmp_path, values, key):
    folder = _write(tmp_path / "model", values)
    with pytest.raises(ValueError, match="no module would run in FP8"):
        _plan(folder)
    found = [f for f in _lint(tmp_path, folder) if f["rule"] == "FP8062"]
    assert [(f["severity"], f["key"]) for f in found] == [("error", key)]


#: Real sizes in the shapes of released models (written here, two layers: the dims are per
#: layer): Falcon-7B (multi_query, 71 heads), Falcon-40B (new_decoder_architecture), Phi-3-mini
#: and -medium, Mixtral-8x7B, Qwen1.5-MoE-A2.7B, Pythia-1B; and a Mistral fine-tune that added
#: two tokens to an untied head (vocab 32002).
REAL = {
    "falcon-7b": {"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71,
                  "multi_query": True, "vocab_size": 65024},
    "falcon-40b": {"model_type": "falcon", "hidden_size": 8192, "num_attention_heads": 128,
                   "num_kv_heads": 8, "new_decoder_architecture": True, "vocab_size": 65024},
    "phi-3-mini": {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064},
    "phi-3-medium": {"model_type": "phi3", "hidden_size": 5120, "intermediate_size": 17920,
                     "num_attention_heads": 40, "num_key_value_heads": 10, "vocab_size": 32064},
    "mixtral-8x7b": {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000},
    "qwen1.5-moe-a2.7b": {"model_type": "qwen2_moe", "hidden_size": 2048,
                          "intermediate_size": 5632, "moe_intermediate_size": 1408,
                          "shared_expert_intermediate_size": 5632, "num_attention_heads": 16,
                          "num_key_value_heads": 16, "num_experts": 60, "vocab_size": 151936},
    "pythia-1b": {"model_type": "gpt_neox", "hidden_size": 2048, "intermediate_size": 8192,
                  "num_attention_heads": 8, "vocab_size": 50304},
    "mistral-7b +2 tokens": {"model_type": "mistral", "hidden_size": 4096,
                             "intermediate_size": 14336, "num_attention_heads": 32,
                             "num_key_value_heads": 8, "vocab_size": 32002},
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_sizes_agree_with_te_swap(tmp_path, name):
    """Built on the meta device, planned (not converted) with keep_lm_head false: the linter
    warns exactly where te_swap keeps a linear for its dims (the +2-token head alone)."""
    from foundry_fp8.swap import plan_swap

    folder = _write(tmp_path / "model", {**REAL[name], "num_hidden_layers": 2})
    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    plan = plan_swap(model, SwapConfig(backend="emulate", keep_lm_head=False),
                     precision="amp_bf16")
    kept = [d.name for d in plan.decisions
            if not d.convert and "breaks TE's FP8 rule" in d.reason and not _moe(d.name)]
    found = _lint(tmp_path, folder, swap={"keep_lm_head": False})
    assert kept == (["lm_head"] if name.endswith("tokens") else [])
    assert [f["rule"] for f in found] == (["FP8063"] if kept else [])
