"""A `model.ffn_config` that is not a mapping: LLM-Foundry's train refuses it in validate_config
(`model.get('ffn_config', {}).get(...)`, AttributeError) for every model, before anything is
built; the linter says so at its line (FP8022). The reference is LLM-Foundry's own train path:
omegaconf's load, make_dataclass_and_log_config and validate_config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from tests.foundry_train import train_refuses

MODEL = {"name": "mpt_causal_lm", "d_model": 128, "n_heads": 4, "n_layers": 2,
         "expansion_ratio": 4, "max_seq_len": 128, "vocab_size": 50368,
         "attn_config": {"attn_impl": "torch"}, "loss_fn": "torch_crossentropy"}
LOADER = {"name": "text", "dataset": {"local": "./data", "split": "train",
                                      "max_seq_len": 128}, "num_workers": 0}
CONFIG = {"max_seq_len": 128, "model": MODEL, "tokenizer": {"name": "gpt2"},
          "train_loader": LOADER, "optimizer": {"name": "decoupled_adamw", "lr": 1.0e-4},
          "scheduler": {"name": "constant_with_warmup", "t_warmup": "1ba"},
          "max_duration": "2ba", "global_train_batch_size": 8,
          "device_train_microbatch_size": 8, "precision": "amp_bf16"}


@pytest.mark.parametrize("fc_type", ["torch", "te"])
@pytest.mark.parametrize("ffn_config", [None, 5, "mptmlp", ["mptmlp"], {}, {"ffn_type": "mptmlp"}])
def test_a_non_mapping_ffn_config_is_fp8022_as_llmfoundrys_train_refuses_it(
        tmp_path: Path, ffn_config: Any, fc_type: str) -> None:
    config = {**CONFIG, "model": {**MODEL, "fc_type": fc_type, "ffn_config": ffn_config}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    found = [(f["key"], f["line"]) for f in entry["findings"] if f["rule"] == "FP8022"]
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1)
                if text.startswith("  ffn_config:"))
    refused = train_refuses(path, AttributeError)
    assert refused == (not isinstance(ffn_config, dict))
    assert found == ([("model.ffn_config", line)] if refused else [])


@pytest.mark.parametrize("fc_type", ["torch", "te", None, {"name": "te"}])
@pytest.mark.parametrize("ffn_type", [None, 5, 1.5, True, ["te_ln_mlp"], {"a": 1}, "mptmlp"])
def test_an_ffn_type_that_is_no_string_is_fp8022_where_llmfoundrys_train_refuses_it(
        tmp_path: Path, ffn_type: Any, fc_type: Any) -> None:
    """validate_config reads `'te' in ffn_type` unless fc_type is the string 'te' (TypeError
    for null or a number), then `ffn_type in ffns_with_megablocks` (unhashable list)."""
    model = {**MODEL, "ffn_config": {"ffn_type": ffn_type}}
    if fc_type is not None:
        model["fc_type"] = fc_type
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "model": model}, sort_keys=False))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    found = [(f["key"], f["line"]) for f in entry["findings"] if f["rule"] == "FP8022"]
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1)
                if text.startswith("    ffn_type:"))
    refused = train_refuses(path, TypeError)
    assert found == ([("model.ffn_config.ffn_type", line)] if refused else [])
