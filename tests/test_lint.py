"""`foundry-fp8 lint`: each rule fires on a broken config (with its key, line and column) and
stays quiet on a near miss, the three output formats, the generated docs, and bad files
exiting 2 with one line. No torch here: the linter must work without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import exit_code, lint_file
from foundry_fp8.lint.docs import rules_markdown
from foundry_fp8.lint.known import MPT_NUMBER_KEYS
from foundry_fp8.lint.load import load_config
from foundry_fp8.lint.output import render_sarif, render_text, use_colour
from foundry_fp8.lint.rules import RULES, LintContext, all_rules, lint_config

REPO = Path(__file__).resolve().parents[1]

BASE = """\
variables:
  seq: 2048
max_seq_len: ${variables.seq}
precision: amp_bf16
device_train_microbatch_size: 8
model:
  name: mpt_causal_lm
  d_model: 2048
  n_heads: 16
  n_layers: 24
  expansion_ratio: 4
  max_seq_len: ${variables.seq}
  loss_fn: torch_crossentropy
tokenizer:
  name: EleutherAI/gpt-neox-20b
  kwargs:
    model_max_length: ${variables.seq}
train_loader:
  name: text
  dataset:
    local: ./my-copy-c4
    split: train
    shuffle: true
    max_seq_len: ${variables.seq}
  drop_last: true
  num_workers: 8
optimizer:
  name: decoupled_adamw
  lr: 6.0e-4
scheduler:
  name: cosine_with_warmup
  t_warmup: 100ba
max_duration: 100ba
global_train_batch_size: 256
fsdp_config:
  sharding_strategy: FULL_SHARD
  activation_checkpointing: false
"""

BASE_LINES = len(BASE.splitlines())
#: A top-level key `_write` leaves out of BASE.
ABSENT = "<absent>"

FP8_TE = {"precision": "amp_fp8", "model": {"fc_type": "te"}}
CKPT = {"fsdp_config": {"activation_checkpointing": True}}
TE_CKPT = {**FP8_TE, "fsdp_config": {"activation_checkpointing": True,
                                     "te_checkpoint_wrapper": True,
                                     "activation_checkpointing_reentrant": False}}
EMULATE = {"algorithms": {"te_swap": {"backend": "emulate"}}}
GENERATE = {"prompts": ["The capital of France is", "Here is a quick story:"],
            "interval": "500ba", "max_new_tokens": 32, "do_sample": False}
TEXT = {"name": "text", "num_workers": 0}
HF_CORPUS = REPO / "tests" / "hf_configs"  # tiny save_pretrained configs
HF = {"model": {"name": "hf_causal_lm", "pretrained": False},
      "algorithms": {"te_swap": {"backend": "emulate"}}}


def _merge(*edits: dict) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.merge(*(OmegaConf.create(e) for e in edits)))


# rule -> (edit that triggers it, key it must name, FSDP version). The near miss below is the
# closest config that must not trigger it.
CASES: dict[str, tuple[dict, str, int]] = {
    "FP8001": ({"precision": "amp_fp8"}, "precision", 1),
    "FP8002": (_merge(FP8_TE, CKPT), "fsdp_config.activation_checkpointing", 1),
    "FP8003": (_merge(FP8_TE, CKPT, {"fsdp_config": {"te_checkpoint_wrapper": True}}),
               "fsdp_config.te_checkpoint_wrapper", 1),
    "FP8004": ({"model": {"ffn_config": {"ffn_type": "te_ln_mlp", "ffn_act_fn": {"name": "gelu"}}}},
               "model.ffn_config.ffn_act_fn", 1),
    "FP8005": (_merge(FP8_TE, {"model": {"d_model": 2040}}), "model.d_model", 1),
    "FP8006": (_merge(FP8_TE, {"device_train_microbatch_size": 3, "variables": {"seq": 2045}}),
               "train_loader.dataset.max_seq_len", 1),
    "FP8007": ({"precision_config": {"amax_history_len": 1024}}, "precision_config", 1),
    "FP8008": (_merge(EMULATE, {"algorithms": {"te_swap": {"fp8_recipe": {"fp8_format": "E5M2"}}}}),
               "algorithms.te_swap.fp8_recipe.fp8_format", 1),
    "FP8009": ({"precison": "amp_fp8"}, "precison", 1),
    "FP8010": ({"fsdp_config": {"activation_checkpointing_reentrnt": False}},
               "fsdp_config.activation_checkpointing_reentrnt", 1),
    "FP8011": ({"precision": "amp-fp8"}, "precision", 1),
    "FP8012": ({"fsdp_config": {"mixed_precision": "PUER"}}, "fsdp_config.mixed_precision", 1),
    "FP8013": (_merge(EMULATE, CKPT), "fsdp_config.activation_checkpointing", 1),
    "FP8014": ({"fsdp_config": {"te_checkpoint_wrapper": True}},
               "fsdp_config.te_checkpoint_wrapper", 1),
    "FP8015": (TE_CKPT, "fsdp_config.activation_checkpointing", 2),
    "FP8016": ({"model": {"fc_type": {"name": "te"}}}, "model.fc_type", 1),
    "FP8017": ({"run_name": "${oc.env:USER}"}, "run_name", 1),
    "FP8018": ({"train_loader": TEXT}, "train_loader.num_workers", 1),
    "FP8019": ({"callbacks": {"fp8_stats": {"intervl": "10ba"}}}, "callbacks.fp8_stats.intervl", 1),
    "FP8020": (_merge(EMULATE, {"algorithms": {"te_swap": {"keep_first_blocks": "two"}}}),
               "algorithms.te_swap.keep_first_blocks", 1),
    "FP8021": ({"algorithms": {"te_swap": {}}}, "algorithms.te_swap", 1),
    "FP8022": ({"callbacks": ["fp8_stats", "fp8_state"]}, "callbacks", 1),
    "FP8023": ({"callbacks": {"fp8_lint": {"fail_on": "warning"}}}, "callbacks.fp8_lint.fail_on", 1),
    "FP8024": ({"model": {"ffn_config_defaults": {"ffn_type": "te_ln_mlp"}}},
               "model.ffn_config_defaults", 1),
    "FP8025": (_merge(FP8_TE, CKPT, {"fsdp_config": {"te_checkpoint_wrapper": True,
                                                     "activation_checkpointing_reentrant": True}}),
               "fsdp_config.activation_checkpointing_reentrant", 1),
    "FP8026": ({"callbacks": {"te_swap": {}}}, "callbacks.te_swap", 1),
    "FP8027": (_merge(EMULATE, {"save_folder": "ckpt"}), "algorithms.te_swap", 1),
    "FP8028": (_merge({"precision": "amp_fp8"}, EMULATE), "precision", 1),
    "FP8029": ({"model": {"loss_fn": "fused_crossentropy"}}, "model.loss_fn", 1),
    "FP8030": ({"model": {"ffn_config": {"ffn_type": "te_ln_mlp"}}}, "model.ffn_config.ffn_type",
               1),
    "FP8031": ({"device_train_microbatch_size": "auto"}, "device_train_microbatch_size", 1),
    "FP8032": ({"model": {"expansion_ratio": 2.67}}, "model.expansion_ratio", 1),
    "FP8033": ({"callbacks": {"fp8_guard": {}}}, "callbacks.fp8_guard", 1),
    "FP8034": ({"precision": "amp_fp8", "algorithms": {"te_swap": {
        "keep_first_blocks": 12, "keep_last_blocks": 12}}}, "algorithms.te_swap.keep_first_blocks",
               1),
    "FP8035": ({"model": {"d_model": "2048"}}, "model.d_model", 1),
    "FP8036": ({"run_name": "???"}, "run_name", 1),
    "FP8037": ({"autoresume": True, "loggers": {"wandb": {"init_kwargs": {"mode": "offline"}}}},
               "autoresume", 1),
    "FP8038": ({"global_train_batch_size": ABSENT}, "global_train_batch_size", 1),
    "FP8039": (_merge(FP8_TE, {"callbacks": {"generate_callback": GENERATE}}),
               "callbacks.generate_callback.prompts", 1),
    "FP8040": (_merge(FP8_TE, {"model": {"use_pad_tok_in_ffn": False},
                               "train_loader": {"name": "finetuning"}}),
               "model.use_pad_tok_in_ffn", 1),
    "FP8041": ({"model": {"attn_config": {"attn_impl": "sdpa"}}}, "model.attn_config.attn_impl",
               1),
    "FP8042": ({"model": {"ffn_config": {"ffn_typ": "mptglu"}}}, "model.ffn_config.ffn_typ", 1),
    "FP8043": ({"global_train_batch_size": float("inf")}, "global_train_batch_size", 1),
    "FP8044": (_merge(FP8_TE, {"fsdp_config": {"mixed_precision": "FULL"}}),
               "fsdp_config.mixed_precision", 1),
    "FP8045": ({"model": {"master_weights_dtype": "fp16"}}, "model.master_weights_dtype", 1),
    # BASE's MPT keys under hf_causal_lm: ComposerHFCausalLM takes none of them
    "FP8046": ({"model": {"name": "hf_causal_lm"}}, "model.d_model", 1),
    "FP8047": ({"eval_loader": {"name": "text", "label": "c4"}}, "eval_loader.label", 1),
    "FP8048": ({"callbacks": {"fp8_stats": {"layers": "^blocks"}}}, "callbacks.fp8_stats.layers",
               1),
    "FP8049": ({"load_path": "ckpt/latest-sharded-rank0"}, "load_path", 1),
    "FP8050": (_merge(EMULATE, {"compile_config": {"fullgraph": True}}),
               "compile_config.fullgraph", 1),
    "FP8051": ({"callbacks": {"fp8_stats": {}}, "loggers": {"mlflow": {"synchronous": False}}},
               "loggers.mlflow.synchronous", 1),
    "FP8052": ({"save_folder": "./ckpt/{run_name}/checkpoints",
                "loggers": {"jsonl": {"path": "ckpt/{run_name}/metrics.jsonl"}}},
               "loggers.jsonl.path", 1),
    "FP8053": ({"eval_loader": {"dataset": {"split": "val"}}}, "eval_loader", 1),
    # BASE's fsdp_config, FSDP1: state_dict_type full
    "FP8054": (_merge(FP8_TE, {"load_path": "bf16/ep0-ba4-rank0.pt"}), "load_path", 1),
    "FP8055": (_merge(EMULATE, {"algorithms": {"te_swap": {"exclude": "^transformer\\.blocks"}}}),
               "algorithms.te_swap.exclude", 1),
    "FP8056": ({"callbacks": {"fp8_stats": {"exclude": "^blocks"}}}, "callbacks.fp8_stats.exclude",
               1),
    "FP8057": ({"loggers": {"wandb": {"init_kwargs": {"dir": "runs/{run_name}"}}}},
               "loggers.wandb.init_kwargs.dir", 1),
    # BASE's max_duration: 100ba, batches 0 to 99
    "FP8058": ({"callbacks": {"fp8_stats": {"dump_steps": [100]}}},
               "callbacks.fp8_stats.dump_steps", 1),
    "FP8059": (_merge(EMULATE, {"algorithms": {"te_swap": {"fuse_ln_mlp": True}}}),
               "algorithms.te_swap.fuse_ln_mlp", 1),
    "FP8060": (_merge(FP8_TE, {"tp_config": {"strategy": "ffn"}}), "tp_config.strategy", 1),
    "FP8061": ({"model": {"max_seq_len": 1024}}, "model.max_seq_len", 1),
    "FP8062": (_merge(HF, {"model": {"pretrained_model_name_or_path": str(HF_CORPUS / "gpt2")}}),
               "model.pretrained_model_name_or_path", 1),
    "FP8063": (_merge(HF, {"model": {"pretrained_model_name_or_path": str(HF_CORPUS / "llama")}}),
               "model.pretrained_model_name_or_path", 1),
}

NEAR_MISSES: dict[str, tuple[dict, int]] = {
    "FP8001": (FP8_TE, 1),
    "FP8002": (TE_CKPT, 1),
    "FP8003": (TE_CKPT, 1),
    "FP8004": ({"model": {"ffn_config": {"ffn_type": "te_ln_mlp"}}}, 1),
    "FP8005": (_merge(FP8_TE, {"model": {"d_model": 2064}}), 1),
    "FP8006": (_merge(FP8_TE, {"device_train_microbatch_size": 3}), 1),
    "FP8007": ({"variables": {"precision_config": {"amax_history_len": 1024}}}, 1),
    "FP8008": (_merge(EMULATE, {"algorithms": {"te_swap": {"fp8_recipe": {"fp8_format": "HYBRID"}}}}),
               1),
    "FP8009": ({"variables": {"precison": "amp_fp8"}}, 1),
    "FP8010": ({"fsdp_config": {"activation_checkpointing_reentrant": False}}, 1),
    "FP8011": ({"precision": "AMP_BF16"}, 1),
    "FP8012": ({"fsdp_config": {"mixed_precision": "pure"}}, 1),
    "FP8013": (EMULATE, 1),
    "FP8014": (_merge(FP8_TE, {"fsdp_config": {"te_checkpoint_wrapper": True}}), 1),
    "FP8015": (TE_CKPT, 1),
    "FP8016": ({"model": {"fc_type": "te"}}, 1),
    "FP8017": ({"run_name": "${variables.seq}"}, 1),
    "FP8018": ({"train_loader": {**TEXT, "prefetch_factor": None, "persistent_workers": False}}, 1),
    "FP8019": ({"callbacks": {"fp8_stats": {"interval": "10ba"}}}, 1),
    "FP8020": (_merge(EMULATE, {"algorithms": {"te_swap": {"keep_first_blocks": 2}}}), 1),
    "FP8021": (EMULATE, 1),
    "FP8022": ({"callbacks": {"fp8_stats": {}, "fp8_state": None}}, 1),
    "FP8023": ({"callbacks": {"fp8_lint": {"fail_on": "never"}}}, 1),
    "FP8024": ({"model": {"ffn_config": {"ffn_type": "te_ln_mlp"}}}, 1),
    "FP8025": (TE_CKPT, 1),
    "FP8026": ({"callbacks": {"fp8_stats": {}}, "algorithms": {"gradient_clipping": {}}}, 1),
    "FP8027": (_merge(EMULATE, {"save_folder": "ckpt", "callbacks": {"fp8_state": {}}}), 1),
    "FP8028": (EMULATE, 1),
    "FP8029": ({"model": {"loss_fn": "torch_crossentropy"}}, 1),
    # the workaround: te_swap fuses initialised layers
    "FP8030": ({"precision": "amp_fp8", "algorithms": {"te_swap": {"fuse_ln_mlp": True}},
                "model": {"init_device": "cpu"}}, 1),
    "FP8031": ({"device_train_microbatch_size": "auto", "fsdp_config": None}, 1),
    "FP8032": ({"model": {"expansion_ratio": 2.5}}, 1),  # 5120
    "FP8033": ({"callbacks": {"fp8_stats": {}, "fp8_guard": {}}}, 1),
    "FP8034": ({"precision": "amp_fp8", "algorithms": {"te_swap": {
        "keep_first_blocks": 12, "keep_last_blocks": 11}}}, 1),  # block 12 converts
    "FP8035": ({"model": {"logit_scale": "inv_sqrt_d_model"}}, 1),  # the one word it takes
    "FP8036": ({"variables": {"unused": "???"}}, 1),  # read only through an interpolation
    "FP8037": ({"autoresume": True, "loggers": {"wandb": {"init_kwargs": {"mode": "online"}}}}, 1),
    # device_train_batch_size and device_eval_batch_size are MISSING in TrainConfig too, but
    # update_batch_size_info fills them: BASE gives neither
    "FP8038": ({}, 1),
    "FP8039": (_merge(FP8_TE, {"callbacks": {"generate_callback": {
        **GENERATE, "prompts": GENERATE["prompts"] * 4}}}), 1),  # 8 prompts at a time
    "FP8040": (_merge(EMULATE, {"precision": "amp_fp8", "model": {"use_pad_tok_in_ffn": False},
                                "train_loader": {"name": "finetuning"}}), 1),  # not TE
    "FP8041": ({"model": {"attn_config": {"attn_impl": "sdpa"}},
                "callbacks": {"fp8_lint": {}}}, 1),
    "FP8042": ({"model": {"ffn_config": {"ffn_type": "mptglu", "ffn_hidden_size": 5632}}}, 1),
    # infinity passes as a micro-batch size: cut to the device batch size, with a warning
    "FP8043": ({"device_train_microbatch_size": float("inf")}, 1),
    "FP8044": (_merge(FP8_TE, {"fsdp_config": {"mixed_precision": "DEFAULT"}}), 1),
    "FP8045": ({"model": {"master_weights_dtype": "f16"}}, 1),  # process_init_device's list lacks it
    "FP8046": ({"model": {"pretrained": True}}, 1),  # an MPT model: FP8024's (a warning)
    "FP8047": ({"train_loader": {"timeout": 5, "pin_memory": False}}, 1),
    "FP8048": ({"callbacks": {"fp8_stats": {"layers": "blocks"}}}, 1),
    "FP8049": ({"load_path": "ckpt/latest-rank0.pt"}, 1),  # a monolithic checkpoint: a file
    "FP8050": (_merge(EMULATE, {"compile_config": {"dynamic": False}}), 1),  # no fullgraph
    "FP8051": ({"callbacks": {"fp8_stats": {}}, "loggers": {"mlflow": {"synchronous": True}}},
               1),
    "FP8052": ({"save_folder": "./ckpt/{run_name}/checkpoints",  # ckpt/ alone is no repeat
                "loggers": {"jsonl": {"path": "ckpt/metrics.jsonl"}}}, 1),
    "FP8053": ({"eval_loader": {"name": "finetuning", "dataset": {"split": "val"}}}, 1),
    "FP8054": (_merge(FP8_TE, {"load_path": "bf16/ep0-ba4-rank0.pt",
                               "callbacks": {"fp8_state": {}}}), 1),
    "FP8055": (_merge(EMULATE, {"algorithms": {"te_swap": {
        "exclude": "^model\\.transformer\\.blocks"}}}), 1),
    "FP8056": ({"callbacks": {"fp8_stats": {"exclude": "blocks\\.0\\."}}}, 1),
    "FP8057": ({"loggers": {"wandb": {"init_kwargs": {"dir": "runs/fp8-try"}}}}, 1),
    "FP8058": ({"callbacks": {"fp8_stats": {"dump_steps": [99]}}}, 1),
    # an untied head: keep_lm_head false converts it
    "FP8059": (_merge(EMULATE, {"model": {"tie_word_embeddings": False},
                                "algorithms": {"te_swap": {"keep_lm_head": False}}}), 1),
    "FP8060": ({"tp_config": {"strategy": "ffn"}}, 1),  # torch linears: sharded as planned
    "FP8061": ({"model": {"max_seq_len": 4096}}, 1),  # a model longer than its data
    # GPT-2's head untied to a vocab of 16s: te_swap converts it
    "FP8062": (_merge(HF, {"model": {"pretrained_model_name_or_path": str(HF_CORPUS / "gpt2"),
                                     "config_overrides": {"tie_word_embeddings": False,
                                                          "vocab_size": 50304}},
                           "algorithms": {"te_swap": {"keep_lm_head": False}}}), 1),
    "FP8063": (_merge(HF, {"model": {"pretrained_model_name_or_path": str(HF_CORPUS / "llama"),
                                     "config_overrides": {"intermediate_size": 48}}}), 1),
}

#: A machine without flash-attn (FP8029 judges against what is installed), nor LLM-Foundry,
#: Composer or torch (FP8030 and FP8031 warn).
NO_FLASH = Snapshot(python="3.11")


def _write(tmp_path: Path, edit: dict, name: str = "train.yaml") -> Path:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(BASE), OmegaConf.create(edit)))
    path = tmp_path / name
    path.write_text(OmegaConf.to_yaml({k: v for k, v in cfg.items() if v != ABSENT}))
    return path


def _lint(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})})


def _rules(entry: dict[str, Any]) -> set[str]:
    return {f["rule"] for f in entry["findings"]}


def test_every_rule_has_a_case_and_a_near_miss():
    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids))
    assert set(CASES) == set(ids) == set(NEAR_MISSES)


def test_clean_config_has_no_findings(tmp_path):
    result = _lint(str(_write(tmp_path, {})), "--format", "json")
    assert result.returncode == 0, result.stdout
    assert json.loads(result.stdout)["files"][0]["findings"] == []


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_fires_with_its_key_line_and_column(tmp_path, rule):
    edit, key, fsdp_version = CASES[rule]
    path = _write(tmp_path, edit)
    entry = lint_file(path, fsdp_version, NO_FLASH)
    assert entry["error"] is None, entry["error"]
    hit = [f for f in entry["findings"] if f["rule"] == rule]
    assert hit, entry["findings"]
    assert hit[0]["key"] == key and hit[0]["fix"] and hit[0]["message"]
    if edit.get(key) == ABSENT:  # the file does not have the key: the finding is the file's
        assert hit[0]["line"] is None
        return
    leaf = key.split(".")[-1]
    text = path.read_text().splitlines()[hit[0]["line"] - 1]
    assert text[hit[0]["column"] - 1:].startswith(f"{leaf}:"), (text, hit[0])


@pytest.mark.parametrize("rule", sorted(NEAR_MISSES))
def test_rule_quiet_on_near_miss(tmp_path, rule):
    edit, fsdp_version = NEAR_MISSES[rule]
    entry = lint_file(_write(tmp_path, edit), fsdp_version, NO_FLASH)
    assert entry["error"] is None and rule not in _rules(entry), entry["findings"]


@pytest.mark.parametrize(("edit", "rule", "snippet"), [
    (CASES["FP8009"][0], "FP8009", "did you mean `precision`"),
    (CASES["FP8010"][0], "FP8010", "did you mean `activation_checkpointing_reentrant`"),
    (CASES["FP8011"][0], "FP8011", "did you mean `amp_fp8`"),
    (CASES["FP8012"][0], "FP8012", "did you mean `PURE`"),
    (CASES["FP8019"][0], "FP8019", "did you mean `interval`"),
])
def test_did_you_mean(tmp_path, edit, rule, snippet):
    findings = lint_file(_write(tmp_path, edit))["findings"]
    assert any(f["rule"] == rule and snippet in f["message"] for f in findings), findings


def _lint_dict(edit: dict, **context: Any) -> dict[str, str]:
    """rule -> severity (the most severe) for BASE merged with `edit`, resolved."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(BASE), OmegaConf.create(edit)),
                                 resolve=True)
    found: dict[str, str] = {}
    for f in lint_config(cfg, LintContext(**context)):
        found.setdefault(f.rule, f.severity)
    return found


def test_emulated_recompute_names_fp8_state_only_where_the_run_has_it():
    """FP8013 said "fp8_state refuses this run" in runs without fp8_state."""
    from omegaconf import OmegaConf

    for callbacks, said in (({"fp8_state": {}}, "fp8_state refuses"),
                            ({}, "the recompute runs them without FP8")):
        cfg = OmegaConf.to_container(OmegaConf.merge(*(OmegaConf.create(e) for e in (
            BASE, EMULATE, CKPT))), resolve=True)
        cfg["callbacks"] = callbacks
        [message] = [f.message for f in lint_config(cfg, LintContext()) if f.rule == "FP8013"]
        assert said in message
        assert ("fp8_state" in message) == bool(callbacks)


def test_fp8_state_turns_recompute_errors_into_info():
    with_state = _merge(FP8_TE, CKPT, {"callbacks": {"fp8_state": {}}})
    assert _lint_dict(with_state)["FP8002"] == "info"
    wrapper = _merge(with_state, {"fsdp_config": {"te_checkpoint_wrapper": True}})
    assert _lint_dict(wrapper)["FP8003"] == "info"


def test_reentrant_follows_llmfoundry_flip_for_string_fc_type_only():
    # validate_config turns an explicit `reentrant: true` into false for `fc_type: te`...
    explicit = {"fsdp_config": {"te_checkpoint_wrapper": True,
                                "activation_checkpointing_reentrant": True}}
    assert "FP8003" not in _lint_dict(_merge(FP8_TE, CKPT, explicit))
    # ...but not when the key is absent (Composer's default true stays) or fc_type is a mapping
    assert "FP8003" in _lint_dict(_merge(FP8_TE, CKPT, {"fsdp_config": {
        "te_checkpoint_wrapper": True}}))
    mapping = _merge(FP8_TE, CKPT, explicit, {"model": {"fc_type": {"name": "te"}}})
    assert "FP8003" in _lint_dict(mapping)


def test_te_swap_shapes_are_warnings_native_te_errors():
    hidden = {"model": {"expansion_ratio": 2.5, "d_model": 2056}}  # 2056 % 16 == 8
    assert _lint_dict(_merge(FP8_TE, hidden))["FP8005"] == "error"
    odd_ffn = {"model": {"ffn_config": {"ffn_hidden_size": 5000}}}
    assert _lint_dict(_merge({"precision": "amp_fp8"}, EMULATE, odd_ffn))["FP8005"] == "warning"
    head = {"algorithms": {"te_swap": {"keep_lm_head": False}},
            "model": {"tie_word_embeddings": False, "vocab_size": 50257}}
    assert _lint_dict(_merge(EMULATE, head))["FP8005"] == "warning"
    assert "FP8005" not in _lint_dict(_merge(EMULATE, {"model": {"vocab_size": 50257}}))


@pytest.mark.parametrize(("edit", "key"), [
    ({"deepspeed_config": {"zero_optimization": {"stage": 3}}}, "deepspeed_config"),
    ({"fsdp_config": {"device_mesh": [2, 4]}}, "fsdp_config.device_mesh"),
])
def test_retired_keys(tmp_path, edit, key):
    findings = lint_file(_write(tmp_path, edit))["findings"]
    assert [f["key"] for f in findings if f["rule"] == "FP8007"] == [key]
    assert not {"FP8009", "FP8010"} & {f["rule"] for f in findings}


def test_mixed_precision_mapping():
    found = lint_config({"fsdp_config": {"mixed_precision": {
        "param_dtype": "fp8", "reduce_dtype": "float32", "buffer_dtyp": "bf16",
        "buffer_dtype": "int8"}}})
    assert {(f.key, f.severity) for f in found} == {
        ("fsdp_config.mixed_precision.param_dtype", "warning"),
        ("fsdp_config.mixed_precision.buffer_dtyp", "error"),
        ("fsdp_config.mixed_precision.buffer_dtype", "error")}


def test_fsdp2_keys_are_warnings_under_fsdp1_and_te_flags_under_fsdp2():
    assert _lint_dict({"fsdp_config": {"reshard_after_forward": True}})["FP8010"] == "warning"
    config = {"fsdp_config": {"te_shard_fp8_weight": True, "sharding_strategy": "FULL_SHARD"},
              "precision": "amp_fp8", "model": {"fc_type": "te"}}
    found = lint_config(config, LintContext(fsdp_version=2))
    assert {(f.rule, f.key, f.severity) for f in found if f.rule != "FP8038"} == {
        ("FP8015", "fsdp_config.te_shard_fp8_weight", "warning"),
        ("FP8010", "fsdp_config.sharding_strategy", "warning")}  # FSDP2 drops it


def test_fsdp_version_comes_from_the_environment(tmp_path):
    path = _write(tmp_path, TE_CKPT)
    assert _lint(str(path)).returncode == 0
    result = _lint(str(path), "--format", "json", env={"FSDP_VERSION": "2"})
    assert result.returncode == 1 and "FP8015" in result.stdout


def test_our_entries_options_are_read_from_the_classes():
    found = lint_config({"callbacks": {"fp8_lint": {"train_config": {}, "fail_on": 3},
                                       "fp8_state": {"watch_batches": 2.5, "strict": "yes"}},
                         "loggers": {"jsonl": {"path": 1}},
                         "algorithms": {"te_swap": {"backend": "emulate",
                                                    "module_filter_fn": "my.fn",
                                                    "tokens_per_microbatch": None}}})
    assert {(f.rule, f.key) for f in found} == {
        ("FP8019", "callbacks.fp8_lint.train_config"), ("FP8020", "callbacks.fp8_lint.fail_on"),
        ("FP8020", "callbacks.fp8_state.watch_batches"), ("FP8020", "callbacks.fp8_state.strict"),
        ("FP8020", "loggers.jsonl.path"), ("FP8020", "algorithms.te_swap.module_filter_fn")}


def test_text_loaders_in_list_form_get_their_own_line(tmp_path):
    loaders = [{**TEXT, "prefetch_factor": None, "persistent_workers": False},
               {**TEXT, "persistent_workers": True, "prefetch_factor": None}]
    path = _write(tmp_path, {"eval_loader": loaders})
    hit, = [f for f in lint_file(path)["findings"] if f["rule"] == "FP8018"]
    assert hit["key"] == "eval_loader.1.persistent_workers"
    assert path.read_text().splitlines()[hit["line"] - 1].strip() == "persistent_workers: true"


def test_oc_env_is_reported_even_when_the_variable_is_unset(tmp_path):
    path = tmp_path / "env.yaml"
    path.write_text(BASE + "run_name: ${oc.env:FOUNDRY_FP8_SURELY_UNSET}\n")
    entry = lint_file(path)
    assert entry["error"] is None
    assert [(f["rule"], f["line"]) for f in entry["findings"]] == [("FP8017", BASE_LINES + 1)]


def test_run_scope_skips_file_only_rules():
    config = {"merge": True, "my_metadata_key": 1, "precision": "amp_bf16"}
    # FP8038: a setting with none of the keys `llmfoundry train` needs, in a file
    assert {f.rule for f in lint_config(config)} == {"FP8009", "FP8038"}
    assert lint_config(config, LintContext(scope="run")) == []


def test_pre_commit_hook_runs_our_linter():
    import yaml

    hook, = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    assert {"id", "name", "entry", "language"} <= set(hook)
    assert hook["entry"] == "foundry-fp8 lint" and hook["language"] == "python"
    assert "foundry-fp8 = foundry_fp8.cli:main" in (REPO / "setup.cfg").read_text()


def test_our_yamls_lint_clean():
    result = _lint(str(REPO / "yamls"), str(REPO / "foundry_fp8" / "tools" / "yamls"))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(not os.environ.get("FOUNDRY_FP8_UPSTREAM_YAMLS"),
                    reason="set FOUNDRY_FP8_UPSTREAM_YAMLS to a copy of LLM-Foundry's "
                           "scripts/train/yamls/pretrain")
def test_upstream_pretrain_yamls_lint_without_errors():
    """As docs/lint.md says: no error; FP8029's warning (MPT's default fused_crossentropy loss)
    where flash-attn's cross entropy is not installed, and testing-moe.yaml's mb_dmoe where
    megablocks is not installed; nothing else."""
    folder = Path(os.environ["FOUNDRY_FP8_UPSTREAM_YAMLS"])
    assert sorted(folder.glob("mpt-*.yaml")), f"no mpt-*.yaml in {folder}"
    result = _lint(str(folder), "--format", "json")
    files = json.loads(result.stdout)["files"]
    errors = [(e["path"], e["error"] or f) for e in files
              for f in ([None] if e["error"] else e["findings"])
              if e["error"] or f["severity"] == "error"]
    assert result.returncode == 0 and not errors, errors
    others = [(e["path"], f) for e in files for f in e["findings"]
              if (f["rule"], f["severity"], f["key"]) not in {
                  ("FP8029", "warning", "model"), ("FP8029", "warning", "model.ffn_config.ffn_type")}]
    assert not others, others


# -- exit codes and unreadable files ------------------------------------------------------

@pytest.mark.parametrize(("text", "where"), [
    ("model:\n  d_model: 64\n   n_heads: 4\n", ":3"),
    ("max_seq_len: ${variables.missing}\n", ":1"),
    ("a: 1\na: 2\n", ":"),
    ("--- a\n--- b\n", ":"),
    ("- just\n- a list\n", ":1"),
    ("just a scalar\n", ":1"),
    ("", ": a train config must be a mapping"),
    ("# only a comment\n\n   \n", ": a train config must be a mapping"),
])
def test_unreadable_files_exit_2_with_one_line(tmp_path, text, where):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = _lint(str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and f"{path}{where}" in errors[0], errors


def test_an_empty_file_in_a_folder_leaves_the_others_linted(tmp_path):
    (tmp_path / "a-empty.yaml").write_text("# nothing yet\n")
    broken = _write(tmp_path, {"precision": "amp_fp8"}, name="b-broken.yaml")
    clean = _write(tmp_path, {}, name="c-clean.yaml")
    result = _lint(str(tmp_path), "--format", "json")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    entries = {Path(e["path"]).name: e for e in json.loads(result.stdout)["files"]}
    assert entries["a-empty.yaml"]["error"].startswith(f"{tmp_path / 'a-empty.yaml'}: ")
    assert entries[broken.name]["error"] is None and "FP8001" in _rules(entries[broken.name])
    assert entries[clean.name] == {"path": str(clean), "error": None, "findings": []}


def test_missing_and_binary_files_exit_2(tmp_path):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    result = _lint(str(tmp_path / "nope.yaml"), str(binary))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "nope.yaml" in result.stderr and "bin.yaml" in result.stderr


def test_exit_code_follows_severity():
    def report(*severities: str, error: str | None = None) -> dict:
        findings = [{"severity": s} for s in severities]
        return {"files": [{"path": "x", "error": error, "findings": findings}]}

    assert exit_code(report()) == 0
    assert exit_code(report("warning", "info")) == 0
    assert exit_code(report("warning", "error")) == 1
    assert exit_code(report(error="x:1: bad")) == 2


# -- output formats -------------------------------------------------------------------------

def test_text_is_a_table_without_colour_when_piped(tmp_path):
    path = _write(tmp_path, CASES["FP8001"][0])
    result = _lint(str(path))
    assert result.returncode == 1 and "\033[" not in result.stdout
    row = next(line for line in result.stdout.splitlines() if "FP8001" in line)
    assert row.split()[:4] == ["4:1", "error", "FP8001", "precision"]
    assert "fix: add" in result.stdout
    assert result.stdout.rstrip().endswith("1 error(s), 0 warning(s), 0 info")


def _on_a_terminal(argv: list[str], term: str) -> bytes:
    """What `argv` writes with a pseudo-terminal as its stdout, TERM=`term`."""
    import pty

    main, side = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=side, stderr=side,
                               env={**env, "TERM": term})
    os.close(side)
    out = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # EIO: the terminal's other end closed
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    process.wait(timeout=60)
    return out


@pytest.mark.skipif(sys.platform == "win32", reason="a pseudo-terminal")
@pytest.mark.parametrize("term", ["dumb", "xterm-256color"])
def test_colour_on_a_terminal_follows_grep_on_term_dumb(tmp_path, term):
    """GNU grep's --color=auto (should_colorize: TERM set and not "dumb") is the reference:
    before, TERM=dumb still got ANSI colour from us."""
    import shutil

    grep = shutil.which("grep")
    if grep is None or b"GNU" not in subprocess.run([grep, "--version"],
                                                    capture_output=True).stdout:
        pytest.skip("needs GNU grep as the reference")
    path = _write(tmp_path, CASES["FP8001"][0])
    ours = _on_a_terminal([sys.executable, "-m", "foundry_fp8.cli", "lint", str(path)], term)
    theirs = _on_a_terminal([grep, "--color=auto", "precision", str(path)], term)
    assert b"FP8001" in ours and b"precision" in theirs
    assert (b"\033[" in ours) == (b"\033[" in theirs) == (term != "dumb")


def test_colour_only_on_a_terminal_without_no_color():
    assert use_colour(True, {}) and not use_colour(False, {})
    assert not use_colour(True, {"NO_COLOR": "1"}) and use_colour(True, {"NO_COLOR": ""})
    assert not use_colour(True, {"TERM": "dumb"}) and use_colour(True, {"TERM": "xterm"})
    report = {"files": [{"path": "a.yaml", "error": None, "findings": [
        {"rule": "FP8001", "severity": "error", "key": "precision", "line": 1, "column": 1,
         "message": "m", "fix": "f"}]}]}
    assert "\033[31m" in render_text(report, colour=True)
    assert "\033[" not in render_text(report, colour=False)


def test_json_contract(tmp_path):
    result = _lint(str(_write(tmp_path, CASES["FP8002"][0])), "--format", "json")
    entry, = json.loads(result.stdout)["files"]
    assert set(entry) == {"path", "error", "findings"}
    for f in entry["findings"]:
        assert set(f) == {"rule", "severity", "key", "line", "column", "message", "fix"}
        assert isinstance(f["line"], int) and isinstance(f["column"], int)


def test_sarif_has_the_fields_sarif_2_1_0_requires(tmp_path):
    good = _write(tmp_path, _merge(CASES["FP8002"][0], CASES["FP8016"][0]))
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n")
    result = _lint(str(good), str(bad), "--format", "sarif")
    assert result.returncode == 2
    log = json.loads(result.stdout)
    assert log["version"] == "2.1.0" and log["$schema"].endswith("sarif-2.1.0.json")
    run, = log["runs"]
    driver = run["tool"]["driver"]
    assert isinstance(driver["name"], str) and driver["name"]
    rules = driver["rules"]
    assert [r["id"] for r in rules] == [r.id for r in all_rules()]
    for rule in rules:
        assert rule["shortDescription"]["text"] and rule["help"]["text"]
        assert rule["defaultConfiguration"]["level"] in ("none", "note", "warning", "error")
    assert {r["ruleId"] for r in run["results"]} >= {"FP8002", "FP8016"}
    for result_ in run["results"]:
        assert result_["message"]["text"]
        assert result_["level"] in ("none", "note", "warning", "error")
        assert rules[result_["ruleIndex"]]["id"] == result_["ruleId"]
        location = result_["locations"][0]["physicalLocation"]
        assert location["artifactLocation"]["uri"] == good.as_uri()
        assert location["region"]["startLine"] >= 1 and location["region"]["startColumn"] >= 1
    invocation, = run["invocations"]
    assert invocation["executionSuccessful"] is False
    note, = invocation["toolExecutionNotifications"]
    assert note["level"] == "error" and "bad.yaml" in note["message"]["text"]


def test_sarif_uses_relative_uris_for_relative_paths():
    report = {"files": [{"path": "yamls/a.yaml", "error": None, "findings": [
        {"rule": "FP8001", "severity": "info", "key": "precision", "line": 3, "column": 1,
         "message": "m", "fix": "f"}]}]}
    result, = json.loads(render_sarif(report))["runs"][0]["results"]
    assert result["level"] == "note"
    assert result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "yamls/a.yaml"


@pytest.mark.parametrize("path", ["my yamls/a#1.yaml", "<stdin>", "run%20.yaml"])
def test_sarif_uris_are_uris_that_name_the_path(path):
    """RFC 3986: no space, `<` or `>` in a URI, and `#` starts a fragment (before: the path as
    written, so `a#1.yaml` named `a`). The reference: urllib's reading of the URI back."""
    from urllib.parse import unquote, urlsplit

    report = {"files": [{"path": path, "error": None, "findings": [
        {"rule": "FP8001", "severity": "error", "key": "precision", "line": 1, "column": 1,
         "message": "m", "fix": "f"}]}]}
    result, = json.loads(render_sarif(report))["runs"][0]["results"]
    uri = result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
    parts = urlsplit(uri)
    assert (parts.fragment, parts.query, unquote(parts.path)) == ("", "", path)
    assert not set(uri) & set(' <>"{}|\\^`')


def test_docs_rules_md_is_generated_from_the_registry():
    committed = (REPO / "docs" / "rules.md").read_text()
    assert committed == rules_markdown(), \
        "regenerate: python -m foundry_fp8.lint.docs > docs/rules.md"
    ids = [rule.id for rule in all_rules()]
    assert len(ids) == len(set(ids)) and set(ids) >= {rule.id for rule in RULES}
    for rule in all_rules():
        assert f"## {rule.id}: " in committed and rule.source in committed


# -- speed, no torch, robustness ----------------------------------------------------------

def test_lint_does_not_import_torch():
    """The linter runs where torch is not installed (CI, a laptop); its speed is measured in
    benchmarks/lint_speed.py, not asserted here."""
    path = REPO / "foundry_fp8" / "tools" / "yamls" / "mpt-1b-fp8.yaml"
    code = textwrap.dedent(f"""
        import sys
        from foundry_fp8.cli import main
        main(["lint", {str(path)!r}])
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                       | st.text(max_size=5),
                       lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=8) | st.sampled_from(
                           ["te_swap", "fp8_stats", "fp8_lint", "fp8_state", "jsonl", "fc_type",
                            "name", "ffn_config", "mixed_precision", "num_workers", "fp8_recipe",
                            "recipe", "interval", "tensors", "layers", "include", "path",
                            "dump_folder", "fail_on", "watch_batches", "te_debug", "loss_fn",
                            "ffn_config_defaults", "activation_checkpointing_reentrant",
                            "te_checkpoint_wrapper", "activation_checkpointing"]),
                           inner, max_size=4), max_leaves=12)
_keys = st.sampled_from(["precision", "model", "fsdp_config", "algorithms", "callbacks",
                         "loggers", "max_seq_len", "device_train_microbatch_size",
                         "precision_config", "train_loader", "eval_loader", "eval_loaders",
                         "variables", "precison", "icl_tasks", "icl_tasks_str", "eval_gauntlet",
                         "code_paths", "save_folder", "autoresume", "models"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=6), st.sampled_from([1, 2]))
def test_rules_never_crash_on_random_configs(config, fsdp_version):
    from foundry_fp8.lint.registry import run_rules

    bare = Snapshot(python="3")
    for scope in ("file", "run"):
        context = LintContext(scope=scope, fsdp_version=fsdp_version, snapshot=bare)
        for finding in lint_config(config, context) + run_rules("eval", config, context):
            assert finding.severity in ("error", "warning", "info")
            assert finding.key and finding.message and finding.fix


def _mutations(text: str) -> st.SearchStrategy[str]:
    """The base YAML with a slice deleted, replaced or duplicated (brackets, colons, ...)."""
    return st.tuples(st.integers(0, len(text)), st.integers(0, 12),
                     st.text(alphabet=":{}[]-$#&*!|>'\" \n\tab1", max_size=6)).map(
        lambda t: text[:t[0]] + t[2] + text[t[0] + t[1]:])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_mutations(BASE) | st.text(max_size=80))
def test_files_never_crash_the_linter(tmp_path, text):
    path = tmp_path / "random.yaml"
    path.write_text(text)
    entry = lint_file(path)
    assert exit_code({"files": [entry]}) in (0, 1, 2)
    if entry["error"]:
        assert "\n" not in entry["error"] and entry["error"].startswith(str(path))


def test_a_misspelled_choice_names_the_choices_and_the_closest():
    found = lint_config({"algorithms": {"te_swap": {"backend": "emualte"}}})
    assert [(f.rule, f.key) for f in found] == [("FP8020", "algorithms.te_swap.backend")]
    assert found[0].message == ("te_swap.backend must be one of 'te', 'emulate', got 'emualte' "
                                "(did you mean `emulate`?)")


# -- section shapes LLM-Foundry accepts (FP8022) ---------------------------------------------

#: Modeled on LLM-Foundry's scripts/train/yamls/pretrain/gpt-neo-125m_eval.yaml, with the list
#: form of eval_loader that make_dataclass_and_log_config turns into eval_loaders.
GPT_NEO_EVAL = """\
variables:
  data_local: ./my-copy-c4
  max_seq_len: 2048
max_seq_len: ${variables.max_seq_len}
model:
  name: hf_causal_lm
  pretrained_model_name_or_path: EleutherAI/gpt-neo-125M
  pretrained: false
tokenizer:
  name: EleutherAI/gpt-neo-125M
train_loader:
  name: text
  dataset: {local: '${variables.data_local}', split: train, max_seq_len: 2048}
  num_workers: 8
eval_loader:
  - label: c4
    name: text
    dataset: {local: '${variables.data_local}', split: val, max_seq_len: 2048}
    num_workers: 8
  - label: c4_small
    name: text
    dataset: {local: '${variables.data_local}', split: val_small, max_seq_len: 2048}
    num_workers: 8
scheduler: {name: cosine_with_warmup, t_warmup: 100ba, alpha_f: 0.1}
optimizer: {name: decoupled_adamw, lr: 6.0e-4, betas: [0.9, 0.95]}
max_duration: 4800ba
eval_interval: 500ba
global_train_batch_size: 256
device_eval_batch_size: 4
device_train_microbatch_size: 4
precision: amp_bf16
icl_tasks: eval/yamls/tasks_v0.2.yaml  # a path: LLM-Foundry reads it as icl_tasks_str
icl_subset_num_batches: 2
eval_gauntlet: 'eval/yamls/eval_gauntlet_v0.2.yaml'
icl_seq_len: 1024
code_paths: [my_code.py]
callbacks:
  speed_monitor: {window_size: 10}
  lr_monitor: {}
"""


def test_gpt_neo_eval_style_config_lints_clean(tmp_path):
    path = tmp_path / "gpt-neo-125m_eval.yaml"
    path.write_text(GPT_NEO_EVAL)
    result = _lint(str(path), "--format", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["files"][0]["findings"] == []


@pytest.mark.parametrize(("edit", "key"), [
    ({"icl_tasks": {"label": "x"}}, "icl_tasks"),
    ({"icl_tasks": ["tasks.yaml"]}, "icl_tasks.0"),
    ({"eval_gauntlet": ["a", "b"]}, "eval_gauntlet"),
    ({"eval_loader": [{"name": "text"}, "c4"]}, "eval_loader.1"),
    ({"eval_loader": "c4"}, "eval_loader"),
    ({"eval_loaders": {"name": "text"}}, "eval_loaders"),
    ({"code_paths": "my_code.py"}, "code_paths"),
    ({"loggers": ["jsonl"]}, "loggers"),
    ({"algorithms": "te_swap"}, "algorithms"),
    ({"tokenizer": None}, "tokenizer"),  # mandatory: not Optional
    ({"eval_loader": {"name": "text"}, "eval_loaders": [{"name": "text"}]}, "eval_loaders"),
    ({"icl_tasks": None, "icl_tasks_str": "tasks.yaml"}, "icl_tasks_str"),
])
def test_section_shapes_llmfoundry_refuses(edit, key):
    found = [f for f in lint_config(edit) if f.rule == "FP8022"]
    assert [f.key for f in found] == [key], found
    assert "FP8009" not in {f.rule for f in lint_config(edit)}


@pytest.mark.parametrize("edit", [
    {"eval_loader": [{"name": "text"}]}, {"eval_loader": []}, {"eval_loader": None},
    {"eval_loaders": [{"name": "text"}]}, {"icl_tasks": [{"label": "x"}]}, {"icl_tasks": ""},
    {"eval_gauntlet": {"weighting": "EQUAL"}}, {"eval_gauntlet": "gauntlet.yaml"},
    {"code_paths": ["a.py", 1]}, {"save_ignore_keys": []}, {"loggers": None},
    {"eval_loader": None, "eval_loaders": [{"name": "text"}]}, {"icl_tasks_str": "tasks.yaml"},
])
def test_section_shapes_llmfoundry_accepts(edit):
    assert "FP8022" not in {f.rule for f in lint_config(edit)}


def test_keys_that_are_not_strings_are_named_at_their_line(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(BASE + "1: 2\ncallbacks:\n  on: {}\n")  # `on` is a bool in YAML 1.1
    entry = lint_file(path)
    assert entry["error"] is None
    found = [(f["rule"], f["key"], f["line"]) for f in entry["findings"]]
    assert found == [("FP8022", "1", BASE_LINES + 1), ("FP8022", "callbacks.True", BASE_LINES + 3)]
    assert "keys must be strings" in entry["findings"][0]["message"]
    # deeper down LLM-Foundry does not check, so neither do we
    deeper = lint_config({"model": {"config_overrides": {"id2label": {0: "neg"}}}})
    assert not deeper  # a `model:` fragment: not judged as a train config (FP8038) either


# -- load messages -------------------------------------------------------------------------

def _load_error(tmp_path: Path, text: str) -> str:
    """The one line linting `text` prints (exit 2, no traceback), after `error: <path>`."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = _lint(str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    error, = result.stderr.strip().splitlines()
    assert error.startswith(f"error: {path}"), error
    return error.removeprefix(f"error: {path}")


@pytest.mark.parametrize(("text", "where"), [
    ("model:\n\td_model: 64\n", ":2:1"),
    ("model:\n  d_model: 64\n\tn_heads: 4\n", ":3:1"),
    ("model:\n  d_model: 64\n  \tn_heads: 4\n", ":3:3"),
    ("\tprecision: amp_fp8\n", ":1:1"),
    ("a: |\n\tx\n", ":2:1"),
])
def test_a_tab_in_indentation_is_named(tmp_path, text, where):
    assert _load_error(tmp_path, text) == f"{where}: not valid YAML: a tab is not allowed in " \
                                          "YAML indentation (use spaces)"


@pytest.mark.parametrize(("text", "where", "snippet"), [
    ("precision: amp_bf16\nnull: 3\n", ":2:1", "the key `null` is read as null"),
    ("model:\n  d_model: 64\n  ~: 3\n", ":3:3", "the key `~` is read as null"),
    ("model:\n  ? [1, 2]\n  : 3\n", ":2:5", "the key is a list or a mapping"),
])
def test_keys_omegaconf_refuses_exit_2_at_their_line(tmp_path, text, where, snippet):
    error = _load_error(tmp_path, text)
    assert error.startswith(f"{where}: cannot load: {snippet}"), error
    assert "keys must be strings" in error


@pytest.mark.parametrize(("text", "where", "snippet"), [
    ("".join(f"k{i}: {i}\n" for i in range(8)) + 'foo: "${a.b.c"\n', ":9:",
     "cannot load key foo: no viable alternative at input '${a.b.c'"),
    ("variables:\n  x: 1\nfoo: ${\n", ":3:", "cannot load key foo: no viable alternative"),
    ("variables:\n  x: 1\nseed: !!set {a, b}\n", ":3:",
     "cannot load key seed: Value 'set' is not a supported primitive type"),
    ("callbacks:\n  x:\n    - 1\n    - \"${a\"\n", ":4:", "cannot load key callbacks.x.1: "),
    ("variables:\n  x: 1\nfoo: ${nope}\n", ":3:", "cannot resolve key foo: "),
    ("name: run\nimage: img\nparameters:\n  seed: 1\n  foo: ${nope}\n", ":5:",
     "cannot resolve key parameters.foo: "),
    ("name: run\nimage: img\nparameters:\n  seed: 1\n  foo: ${\n", ":5:",
     "cannot load key parameters.foo: "),
])
def test_values_omegaconf_refuses_are_named_with_their_key_and_line(tmp_path, text, where,
                                                                   snippet):
    error = _load_error(tmp_path, text)
    assert error.startswith(f"{where} {snippet}"), error


def test_an_oc_env_value_is_not_judged_as_the_text_it_holds(tmp_path):
    path = _write(tmp_path, {"precision": "${oc.env:PREC,amp_fp8}",
                             "fsdp_config": {"mixed_precision": "${oc.env:MP}"}})
    result = _lint(str(path), "--format", "json")
    findings = json.loads(result.stdout)["files"][0]["findings"]
    assert sorted((f["rule"], f["key"]) for f in findings) == [
        ("FP8017", "fsdp_config.mixed_precision"), ("FP8017", "precision")]
    path = _write(tmp_path, {"precision": "amp-fp8", "run_name": "${oc.env:USER}"})
    assert _rules(lint_file(path)) == {"FP8011", "FP8017"}  # other keys are still judged
    # a key's name is judged whatever its value: a typo stays a typo once the value is fixed
    path = _write(tmp_path, {"precison": "${oc.env:PREC}", "callbacks": {"fp8_stat": "${oc.env:X}"}})
    found = {(f["rule"], f["key"]) for f in lint_file(path)["findings"]}
    assert {("FP8009", "precison"), ("FP8026", "callbacks.fp8_stat"),
            ("FP8017", "precison"), ("FP8017", "callbacks.fp8_stat")} <= found, found


def test_omegaconfs_own_warnings_stay_out_of_the_output(tmp_path):
    path = _write(tmp_path, {"variables": {"old": 1, "new": "${oc.deprecated:variables.old}"}})
    result = _lint(str(path))
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_omegaconfs_node_limit_is_named_as_such(tmp_path):
    from omegaconf import OmegaConf

    text = "variables:\n" + "".join(f"  k{i}: {i}\n" for i in range(6_000))  # 12,003 values
    try:
        OmegaConf.create(text)
        pytest.skip("this omegaconf has no node limit")
    except Exception as e:  # noqa: BLE001  (whichever error this omegaconf raises)
        limit = str(e)
    error = _load_error(tmp_path, text)
    # Before: always at :1:1 (omegaconf marks the document's start). The 10,001st value counted
    # as omegaconf counts (the mappings, then each key and value): line 5000's value, `4998`.
    assert error.startswith(":5000:10: omegaconf, which LLM-Foundry reads YAML with, refuses it "
                            "(value 10001, counting aliases expanded, is here): YAML node "
                            "expansion exceeds"), error
    assert "not valid YAML" not in error and "configured limit of 10000" in limit


def test_omegaconfs_alias_ratio_refusal_names_the_file_not_line_1(tmp_path):
    """omegaconf refuses aliases expanding a document more than 100-fold, marking its first
    line whatever causes it: the refusal names the file alone (before: `:1:1`)."""
    from omegaconf import OmegaConf

    text = ("a: &a [1]\nb: &b [" + ", ".join(["*a"] * 10) + "]\nc: &c ["
            + ", ".join(["*b"] * 10) + "]\nd: &d [" + ", ".join(["*c"] * 10) + "]\ne: [*d, *d, *d]\n")
    try:
        OmegaConf.create(text)
        pytest.skip("this omegaconf has no alias expansion ratio")
    except Exception as e:  # noqa: BLE001  (whichever error this omegaconf raises)
        if "ratio" not in str(e):
            pytest.skip("this omegaconf refuses it otherwise")
    error = _load_error(tmp_path, text)
    assert error.startswith(": omegaconf, which LLM-Foundry reads YAML with, refuses it: YAML "
                            "aliases expand the document"), error


def test_a_folder_without_yaml_exits_2_naming_it(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    (tmp_path / "empty" / "notes.txt").write_text("no YAML here")
    folder = tmp_path / "empty"
    result = _lint(str(folder))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    error, = result.stderr.strip().splitlines()
    assert error == f"error: {folder}: no .yaml or .yml file in this folder"
    assert "0 file(s) linted" in result.stdout and "1 path(s) could not be linted" in result.stdout
    # next to a folder with YAML it still fails the run
    good = tmp_path / "good"
    good.mkdir()
    _write(good, {})
    result = _lint(str(good), str(folder), "--format", "json")
    assert result.returncode == 2
    errors = [e["error"] for e in json.loads(result.stdout)["files"]]
    assert errors == [None, f"{folder}: no .yaml or .yml file in this folder"]


def test_te_swap_without_fp8_state_is_said_only_where_checkpoints_are_saved_or_resumed():
    for key, value in (("save_folder", "s3://bucket/run"), ("load_path", "ckpt.pt"),
                       ("autoresume", True)):
        assert "FP8027" in _lint_dict(_merge(EMULATE, {key: value}))
    assert "FP8027" not in _lint_dict(EMULATE)  # nothing to resume from
    assert "FP8027" not in _lint_dict(_merge(EMULATE, {"autoresume": False}))


def _fp8027(edit: dict) -> list[str]:
    """FP8027's messages for BASE merged with `edit`."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(BASE), OmegaConf.create(edit)),
                                 resolve=True)
    return [f.message for f in lint_config(cfg) if f.rule == "FP8027"]


def test_fp8027_says_what_a_load_path_only_run_loses():
    """A run with only `load_path` loads another run's checkpoint: it resumes nothing of its own;
    without fp8_state Composer drops that checkpoint's FP8State entry (composer/core/state.py,
    State.load_state_dict restores callback entries only into the run's callbacks)."""
    load = {"load_path": "s3://bucket/other/ep0-ba100-rank0.pt"}
    message, = _fp8027(_merge(EMULATE, load))
    assert "(load_path is set)" in message and "not restored" in message
    assert "this run's checkpoints" not in message
    # saving as well: both are said
    message, = _fp8027(_merge(EMULATE, {**load, "save_folder": "ckpt"}))
    assert "(save_folder and load_path are set)" in message and "not restored" in message \
        and "a resume from this run's checkpoints" in message
    # a weights-only load never restores FP8 state, fp8_state or not: nothing to add
    assert _fp8027(_merge(EMULATE, {**load, "load_weights_only": True})) == []
    assert len(_fp8027(_merge(EMULATE, {**load, "load_weights_only": True,
                                        "save_folder": "ckpt"}))) == 1


@pytest.mark.parametrize(("te", "severity"), [
    ("2.20.2", "warning"), ("2.16.1", "warning"), ("2.17.0", None), (None, "info")])
@pytest.mark.parametrize("weights_only", [False, True])
def test_fp8027_load_only_native_te_layers_refuse_a_pickled_checkpoint(te, severity, weights_only):
    """A run that only loads (no save_folder): its own TE layers load the checkpoint's
    `_extra_state`, weights-only or not, and TE 2.16.1, 2.17.1 and >= 2.18 raise 'Refusing to
    load pickled Transformer Engine extra state' on a delayed-scaling pickle unless
    NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 (TE pytorch/_extra_state.py
    should_load_extra_state_pickle), as a checkpoint of this config saved without fp8_state
    holds."""
    load = {"load_path": "s3://bucket/other/ep0-ba100-rank0.pt", "load_weights_only": weights_only}
    snapshot = replace(NO_FLASH, te=te)
    expected = [] if severity is None else [("model.fc_type", severity)]
    assert _found(_merge(FP8_TE, load), snapshot, "FP8027") == expected
    if severity is not None:
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(BASE), OmegaConf.create(
            _merge(FP8_TE, load))), resolve=True)
        finding, = [f for f in lint_config(cfg, LintContext(snapshot=snapshot))
                    if f.rule == "FP8027"]
        assert "(load_path is set)" in finding.message and "resume" not in finding.message
        assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1" in finding.fix
    # current scaling saves no pickle TE refuses; fp8_state's checkpoints hold a pickled None
    for quiet in (_merge(FP8_TE, {**load, "algorithms": {"te_swap": {
                      "fp8_recipe": {"scaling": "current"}}}}),
                  _merge(FP8_TE, {**load, "callbacks": {"fp8_state": {}}})):
        assert [k for k, _ in _found(quiet, snapshot, "FP8027") if k.startswith("model.")] == []


@pytest.mark.parametrize(("te", "severity"), [
    ("2.20.2", "warning"), ("2.18.0", "warning"), ("2.16.1", "warning"), ("2.17.1", "warning"),
    ("2.16.0", None), ("2.17.0", None), ("2.15.2", None),  # these load TE's pickled state
    (None, "info"),  # no TE where the linter runs: said, as what a refusing TE would do
])
def test_native_te_layers_without_fp8_state_follow_the_installed_tes_pickle_guard(te, severity):
    """TE 2.16.1, 2.17.1 and >= 2.18 refuse their own pickled delayed-scaling `_extra_state`
    (facts.refuses_pickled_extra_state): a resume of `fc_type: te` without fp8_state fails."""
    snapshot = replace(NO_FLASH, te=te)
    expected = [] if severity is None else [("model.fc_type", severity)]
    assert _found(_merge(FP8_TE, {"autoresume": True}), snapshot, "FP8027") == expected
    assert _found(_merge({"precision": "amp_fp8", "model": {"ffn_config": {
        "ffn_type": "te_ln_mlp"}}, "save_folder": "ckpt"}), snapshot, "FP8027") == [
        (k.replace("fc_type", "ffn_config.ffn_type"), s) for k, s in expected]
    # not said: fp8_state (a pickled None in its place), nothing to resume, no FP8 autocast,
    # current scaling (the guard is on delayed scaling's state)
    for quiet in (_merge(FP8_TE, {"autoresume": True, "callbacks": {"fp8_state": {}}}), FP8_TE,
                  _merge(FP8_TE, {"autoresume": True, "precision": "amp_bf16"}),
                  _merge(FP8_TE, {"autoresume": True, "algorithms": {"te_swap": {
                      "fp8_recipe": {"scaling": "current"}}}})):
        assert [k for k, _ in _found(quiet, snapshot, "FP8027")
                if k.startswith("model.")] == [], quiet


def test_fp8002_does_not_fire_where_fp8001_applies():
    found = _lint_dict(_merge({"precision": "amp_fp8"}, CKPT))
    assert "FP8001" in found and "FP8002" not in found


def test_the_environment_probe_does_not_import_the_linter():
    """No cycle: `lint/` reads the probe (foundry_fp8.environment); the probe reads nothing of
    the linter's, and the fp8_lint callback uses the probe, not the doctor CLI."""
    import ast

    def imports(module: str) -> set[str]:
        tree = ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())
        return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module} | {a.name for node in ast.walk(tree)
                                    if isinstance(node, ast.Import) for a in node.names}

    assert not {m for m in imports("foundry_fp8.environment")
                if m.startswith(("foundry_fp8.lint", "foundry_fp8.doctor"))}
    assert "foundry_fp8.doctor" not in imports("foundry_fp8.composer.lint")
    assert "foundry_fp8.environment" in imports("foundry_fp8.composer.lint")


# -- eval configs share the train rules' sections ------------------------------------------

#: An MPT eval config in the layout of LLM-Foundry's scripts/eval/yamls/mpt_eval.yaml.
EVAL_BASE = """\
variables:
  max_seq_len: 1024
seed: 1
precision: amp_bf16
max_seq_len: ${variables.max_seq_len}
models:
- model_name: mpt_test
  tokenizer:
    name: EleutherAI/gpt-neox-20b
  model:
    name: mpt_causal_lm
    d_model: 768
    n_heads: 12
    n_layers: 12
    loss_fn: torch_crossentropy
  load_path: ./ckpt/latest-rank0.pt
device_eval_batch_size: 16
fsdp_config:
  sharding_strategy: FULL_SHARD
  mixed_precision: FULL
"""


@pytest.mark.parametrize("rule", sorted(r.id for r in RULES if "eval" in r.also))
def test_eval_configs_are_judged_by_the_train_rules_registered_for_them(tmp_path, rule):
    """A train rule registered with `also=("eval",)` fires on an eval config as on a train one:
    the `foundry-fp8 lint` of an eval config runs it."""
    from omegaconf import OmegaConf

    edit, key, fsdp_version = CASES[rule]
    path = tmp_path / "eval.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.merge(OmegaConf.create(EVAL_BASE),
                                                      OmegaConf.create(edit))))
    entry = lint_file(path, fsdp_version, NO_FLASH)
    assert entry["error"] is None, entry["error"]
    assert [rule, key] in [[f["rule"], f["key"]] for f in entry["findings"]], entry["findings"]


def test_eval_rules_list_their_own_and_the_shared_train_rules():
    from foundry_fp8.lint.registry import rules_for, rules_of

    shared = {r.id for r in RULES if "eval" in r.also}
    assert shared and {r.id for r in rules_for("eval")} == shared | {r.id for r in rules_of("eval")}
    assert not shared & {r.id for r in rules_of("eval")}  # docs list each rule once


# -- what the run refuses later: fp8_guard (FP8033), te_swap converting nothing (FP8034) --------

def test_fp8_guard_needs_fp8_stats_in_its_own_section():
    found = lint_config({"callbacks": {"fp8_guard": {"consecutive": 2}}})
    hit, = [f for f in found if f.rule == "FP8033"]
    assert hit.key == "callbacks.fp8_guard"
    assert "needs callbacks.fp8_stats, whose statistics it acts on" in hit.message
    assert hit.fix == "add `fp8_stats: {}` to callbacks"
    # fp8_stats misplaced under loggers does not count
    misplaced = {"callbacks": {"fp8_guard": {}}, "loggers": {"fp8_stats": {}}}
    assert "FP8033" in {f.rule for f in lint_config(misplaced)}


@pytest.mark.parametrize(("te_swap", "key"), [
    ({"keep_first_blocks": 24}, "keep_first_blocks"),
    ({"keep_last_blocks": 30}, "keep_last_blocks"),
    ({"keep_first_blocks": 12, "keep_last_blocks": 12}, "keep_first_blocks"),
    ({"include": "^lm_head$"}, "include"),  # te_swap sees `model.lm_head`: and it is tied
    ({"include": "^transformer\\."}, "include"),  # names start with `model.`
    ({"exclude": "blocks"}, "exclude"),
    ({"min_gemm_size": 100_000_000_000}, "min_gemm_size"),
    ({"tokens_per_microbatch": 6}, "tokens_per_microbatch"),
    ({"keep_lm_head": False, "include": "lm_head"}, "include"),  # MPT ties the head by default
    ({"backend": "emulate", "exclude": "attn|ffn"}, "exclude"),  # refused at any precision
])
def test_te_swap_options_that_convert_nothing_name_their_key(te_swap, key):
    edit = {"precision": "amp_fp8", "algorithms": {"te_swap": te_swap}}
    assert _found(edit, None, "FP8034") == [(f"algorithms.te_swap.{key}", "error")]


@pytest.mark.parametrize("edit", [
    {"algorithms": {"te_swap": {"keep_first_blocks": 23}}},  # block 23 converts
    {"algorithms": {"te_swap": {"include": r"blocks\.0\.attn"}}},
    {"algorithms": {"te_swap": {"min_gemm_size": 2048}}},  # every block GEMM is 2048 or more
    {"algorithms": {"te_swap": {"include": "lm_head", "keep_lm_head": False}},
     "model": {"tie_word_embeddings": False}},  # an untied head converts
    {"algorithms": {"te_swap": {"include": "norm_f", "convert_layernorm": True}}},
    {"algorithms": {"te_swap": {"exclude": "."}}, "model": {"fc_type": "te"}},  # TE layers run
    {"algorithms": {"te_swap": {"keep_first_blocks": 24}}, "precision": "amp_bf16"},  # FP8021's
    {"algorithms": {"te_swap": {"keep_first_blocks": 24}},
     "model": {"name": "hf_causal_lm"}},  # only MPT is modelled
    {"algorithms": {"te_swap": {"keep_first_blocks": -1}}},  # refused at construction: FP8023
])
def test_te_swap_options_that_convert_something_are_quiet(edit):
    assert _found(_merge({"precision": "amp_fp8"}, edit), None, "FP8034") == []


def test_te_swap_converting_nothing_because_of_the_model_names_no_option():
    edit = {"precision": "amp_fp8", "algorithms": {"te_swap": {}},
            "model": {"d_model": 2040, "n_heads": 8}}
    assert _found(edit, None, "FP8034") == [("algorithms.te_swap", "error")]
    assert _found(edit, None, "FP8005") == [("model.d_model", "error")]


# -- attention GEMM dims (FP8005) ------------------------------------------------------------

GQA = {"attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 1}}


@pytest.mark.parametrize(("model", "te_swap", "expected"), [
    # head_dim 43: Wqkv (48 + 2) x 43 = 2150 wide, not a multiple of 8 for te.Linear's assert
    ({"d_model": 2064, "n_heads": 48, **GQA}, None,
     [("model.attn_config.kv_n_heads", "error")]),
    # an explicit head_dim: out_proj reads n_heads x head_dim = 1080 features
    # (and Wqkv 3 x 1080 = 3240 is divisible by 8, not 16)
    ({"d_model": 1152, "n_heads": 12, "head_dim": 90}, None,
     [("model.head_dim", "warning"), ("model.head_dim", "error")]),
    # Wqkv 1800 wide: TE's forward check passes (1800 % 8), the backward GEMM's inner dim not
    ({"head_dim": 100, **GQA}, None, [("model.head_dim", "warning")]),
    # multi-query attention: one kv head of 43
    ({"d_model": 2064, "n_heads": 48, "attn_config": {"attn_type": "multiquery_attention"}},
     None, [("model.attn_config.attn_type", "error")]),
    # te_swap keeps the attention linears it would convert in high precision
    ({"d_model": 2064, "n_heads": 48, **GQA}, {}, [("model.attn_config.kv_n_heads", "warning")]),
    ({"d_model": 2064, "n_heads": 48, **GQA}, {"exclude": "Wqkv"}, []),
    ({"d_model": 2064, "n_heads": 48, **GQA}, {"include": "ffn"}, []),
    # dims that follow from d_model: MHA, or GQA with a head_dim that fits
    ({"d_model": 2064, "n_heads": 48}, None, []),
    ({"n_heads": 16, "attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 4}},
     None, []),
])
def test_attention_dims_follow_mpts_attention(model, te_swap, expected):
    edit = {"precision": "amp_fp8", "model": {**model, "fc_type": "te" if te_swap is None
                                              else "torch"}}
    if te_swap is not None:
        edit["algorithms"] = {"te_swap": te_swap}
    assert _found(edit, None, "FP8005") == expected


@pytest.mark.parametrize("with_te_swap", [False, True])
def test_a_te_wqkv_off_by_16_is_worded_by_whether_te_swap_is_there(with_te_swap):
    """Before: 'which te_swap's shape rule keeps out of FP8' in a config without te_swap (QA:
    MQA, d_model 1152, 32 heads: Wqkv 1224 wide)."""
    edit: dict = {"precision": "amp_fp8", "model": {
        "d_model": 1152, "n_heads": 32, "fc_type": "te",
        "attn_config": {"attn_type": "multiquery_attention"}}}
    if with_te_swap:
        edit["algorithms"] = {"te_swap": {}}
    message = _messages(edit, "FP8005")["model.attn_config.attn_type"]
    assert "out_features not divisible by 16" in message and "not been run on a GPU" in message
    assert ("te_swap" in message) == with_te_swap, message
    if with_te_swap:
        assert "leaves" in message  # te_swap does not convert a layer that is TE already


def test_attention_of_torch_layers_is_not_judged():
    """te_ln_mlp makes only the FFN a TE layer: the attention stays in torch, out of FP8."""
    edit = {"precision": "amp_fp8", "model": {"d_model": 2064, "n_heads": 48, **GQA,
                                              "ffn_config": {"ffn_type": "te_ln_mlp"}}}
    assert _found(edit, None, "FP8005") == []


# -- the sequence length micro-batches are cut to (FP8006) -----------------------------------

LOADER = {"train_loader": {"name": "text", "dataset": {"local": "./c4", "split": "train",
                                                       "max_seq_len": "${variables.seq}"}}}


@pytest.mark.parametrize(("edit", "expected"), [
    # the loader's length is the one trained on, interpolated or written
    ({"variables": {"seq": 2044}}, [("train_loader.dataset.max_seq_len", 2044)]),
    ({"train_loader": {"dataset": {"max_seq_len": 2050}}},
     [("train_loader.dataset.max_seq_len", 2050)]),
    # the top-level max_seq_len is only ICL's default length
    ({"max_seq_len": 2044}, []),
    ({"max_seq_len": 2044, "train_loader": {"dataset": {"max_seq_len": 2048}}}, []),
])
def test_tokens_per_microbatch_read_the_train_loaders_length(tmp_path, edit, expected):
    path = _write(tmp_path, _merge(FP8_TE, LOADER, {"device_train_microbatch_size": 1}, edit))
    entry = lint_file(path, 1, NO_FLASH)
    lines = path.read_text().splitlines()
    hits = [f for f in entry["findings"] if f["rule"] == "FP8006"]
    assert [(f["key"], int(f["message"].split()[2])) for f in hits] == expected, hits
    for f in hits:  # the line of the loader's key, under train_loader.dataset
        assert lines[f["line"] - 1][f["column"] - 1:].startswith("max_seq_len:")
        assert lines[f["line"] - 1].startswith("    ")


@pytest.mark.parametrize(("micro", "seq", "severity"), [
    (1, 1000, "warning"),  # QA: 1000 tokens, a multiple of 8 and not of 16
    (1, 2040, "warning"), (3, 2040, "warning"), (2, 1004, "warning"),
    (1, 2044, "error"),  # TE's forward assert (8)
    (2, 2040, None), (1, 2048, None), (3, 2048, None),
])
def test_tokens_per_microbatch_by_8_but_not_16_is_a_warning(tmp_path, micro, seq, severity):
    """Before: a multiple of 8 passed silently, though TE's own tests run FP8 only for
    batch x seqlen divisible by 16 and the token count is the inner dim of the wgrad GEMM."""
    path = _write(tmp_path, _merge(FP8_TE, LOADER, {"device_train_microbatch_size": micro,
                                                    "variables": {"seq": seq}}))
    hits = [f for f in lint_file(path, 1, NO_FLASH)["findings"] if f["rule"] == "FP8006"]
    assert [f["severity"] for f in hits] == ([severity] if severity else [])
    if severity == "warning":
        message = hits[0]["message"]
        assert f"{micro * seq} tokens" in message and "multiple of 16" in message
        assert "TE's own tests" in message and "not been run on a GPU" in message


# -- values MPT refuses (FP8035) -------------------------------------------------------------

@pytest.mark.parametrize("path", MPT_NUMBER_KEYS)
def test_numbers_written_as_strings_are_named(path):
    section, _, leaf = path.rpartition(".")
    value: dict = {leaf: "8/3"}
    if section:
        value = {section: {**value, **({"attn_type": "grouped_query_attention"}
                                       if leaf == "kv_n_heads" else {})}}
    found = _found({"model": value}, None, "FP8035")
    assert found == [(f"model.{path}", "error")]


@pytest.mark.parametrize(("model", "expected"), [
    ({"n_heads": 12}, [("model.n_heads", "error")]),  # 2048 / 12
    ({"n_heads": 12, "head_dim": 90}, [("model.n_heads", "error")]),  # head_dim does not help
    ({"n_heads": 16, "norm_eps": "1e-5"}, []),  # a string norm_eps builds
    ({"attn_config": {"kv_n_heads": "2"}}, []),  # MHA takes no kv_n_heads at all
    ({"name": "hf_causal_lm", "d_model": "2048"}, []),  # only MPT is judged
])
def test_values_mpt_refuses(model, expected):
    assert _found({"model": model}, None, "FP8035") == expected


# -- upstream crashes judged against the installed versions (FP8030, FP8031) -----------------

#: The H200 of the first GPU run (benchmarks/results/mpt-1b-nvidia-h200-te-native.json).
H200_SET = Snapshot(python="3.12.3", torch="2.11.0+cu130", composer="0.32.1",
                    llmfoundry="0.22.0")
TE_LN_MLP = {"precision": "amp_fp8", "model": {"ffn_config": {"ffn_type": "te_ln_mlp"}}}
FUSED_ON_META = {"precision": "amp_fp8", "algorithms": {"te_swap": {"fuse_ln_mlp": True}},
                 "model": {"init_device": "meta"}}


def _installed(**versions: str | None) -> Snapshot:
    return replace(H200_SET, **versions)


def _found(edit: dict, snapshot: Snapshot, rule: str, fsdp_version: int = 1,
           ) -> list[tuple[str, str]]:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(BASE), OmegaConf.create(edit)),
                                 resolve=True)
    context = LintContext(snapshot=snapshot, fsdp_version=fsdp_version)
    return [(f.key, f.severity) for f in lint_config(cfg, context) if f.rule == rule]


@pytest.mark.parametrize(("llmfoundry", "severity"), [
    ("0.22.0", "error"), ("0.21.0", "error"), ("0.8.0", "error"),
    ("0.23.0.dev0", "error"),  # no release fixes it: a newer one is judged affected
    ("0.7.0", None),  # before the param-init registry (PR #1096)
    (None, "warning"),  # not installed where the linter runs
])
def test_te_ln_mlp_init_follows_the_installed_llmfoundry(llmfoundry, severity):
    expected = [] if severity is None else [("model.ffn_config.ffn_type", severity)]
    assert _found(TE_LN_MLP, _installed(llmfoundry=llmfoundry), "FP8030") == expected


@pytest.mark.parametrize(("edit", "key"), [
    (TE_LN_MLP, "model.ffn_config.ffn_type"),
    (_merge(TE_LN_MLP, {"model": {"init_device": "meta"}}), "model.ffn_config.ffn_type"),
    (_merge(TE_LN_MLP, {"model": {"init_config": {"name": "xavier_uniform_"}}}),
     "model.ffn_config.ffn_type"),
    (FUSED_ON_META, "algorithms.te_swap.fuse_ln_mlp"),
    (_merge(FUSED_ON_META, {"model": {"init_device": "mixed"}}), "algorithms.te_swap.fuse_ln_mlp"),
    # quiet: the init scheme that skips LLM-Foundry's module inits
    (_merge(TE_LN_MLP, {"model": {"init_config": {"name": "default_"}}}), None),
    # quiet: te_swap fuses weights that are already initialised
    (_merge(FUSED_ON_META, {"model": {"init_device": "cpu"}}), None),
    (_merge(FUSED_ON_META, {"fsdp_config": None}), None),  # meta without FSDP becomes cpu
    (_merge(FUSED_ON_META, {"algorithms": {"te_swap": {"backend": "emulate"}}}), None),
    (_merge(FUSED_ON_META, {"algorithms": {"te_swap": {"fuse_ln_mlp": False}}}), None),
    # quiet: blocks te_swap does not fuse (swap._fusable_mlp)
    (_merge(FUSED_ON_META, {"model": {"fc_type": "te"}}), None),
    (_merge(FUSED_ON_META, {"model": {"ffn_config": {"ffn_type": "mptglu"}}}), None),
    (_merge(FUSED_ON_META, {"model": {"ffn_config": {"ffn_act_fn": {"name": "silu"}}}}), None),
    (_merge(FUSED_ON_META, {"model": {"ffn_config": {"ffn_act_fn": {"name": "relu"}}}}),
     "algorithms.te_swap.fuse_ln_mlp"),  # TE's relu is MPT's (910c52c)
    (_merge(FUSED_ON_META, {"model": {"norm_type": "triton_rmsnorm"}}), None),
    (_merge(FUSED_ON_META, {"model": {"norm_type": "rmsnorm", "norm_eps": None}}), None),
    (_merge(FUSED_ON_META, {"model": {"no_bias": True}}), None),
    # an RMSNorm fuses (normalization: RMSNorm), with or without biases
    (_merge(FUSED_ON_META, {"model": {"norm_type": "rmsnorm"}}), "algorithms.te_swap.fuse_ln_mlp"),
    (_merge(FUSED_ON_META, {"model": {"norm_type": "low_precision_rmsnorm", "no_bias": True}}),
     "algorithms.te_swap.fuse_ln_mlp"),
    (_merge(FUSED_ON_META, {"model": {"name": "hf_causal_lm"}}), None),
    (_merge(FUSED_ON_META, {"model": {"norm_type": "layernorm",
                                      "ffn_config": {"ffn_act_fn": {"name": "gelu"}}}}),
     "algorithms.te_swap.fuse_ln_mlp"),
    # MPT ignores ffn_config_defaults: FP8024 says so, FP8030 does not double-report
    ({"precision": "amp_fp8", "model": {"ffn_config_defaults": {"ffn_type": "te_ln_mlp"}}},
     None),
])
def test_te_layernorm_mlp_reaching_llmfoundrys_init(edit, key):
    """te_ln_mlp crashes (error); te_swap declines to fuse on meta weights (warning)."""
    severity = "warning" if key == "algorithms.te_swap.fuse_ln_mlp" else "error"
    assert _found(edit, H200_SET, "FP8030") == ([] if key is None else [(key, severity)])


@pytest.mark.parametrize(("composer", "torch", "severity"), [
    ("0.32.1", "2.11.0+cu130", "error"),  # the H200 run
    ("0.32.1", "2.7.0", None), ("0.31.0", "2.6.0", None), ("0.31.0", "2.7.0+cu126", None),
    ("0.31.0", "2.7.1", "error"), ("0.32.0", "2.5.1", "error"),
    ("0.33.0.dev0", "2.8.0", "error"),  # main: unchanged, no release fixes it
    ("0.30.0", "2.11.0", "warning"),  # older than the releases checked
    (None, "2.11.0", "warning"), ("0.32.1", None, "warning"),
])
def test_auto_microbatch_with_fsdp_follows_installed_composer_and_torch(composer, torch,
                                                                        severity):
    found = _found({"device_train_microbatch_size": "auto"},
                   _installed(composer=composer, torch=torch), "FP8031")
    assert found == ([] if severity is None else [("device_train_microbatch_size", severity)])


@pytest.mark.parametrize(("edit", "fsdp_version", "fires"), [
    ({"device_train_microbatch_size": "auto", "fsdp_config": {}}, 1, True),  # FSDP defaults
    ({"device_train_microbatch_size": "auto", "fsdp_config": None}, 1, False),  # no FSDP
    ({"device_train_microbatch_size": "auto"}, 2, False),  # FSDP2 refuses auto before this
    ({"device_train_microbatch_size": 8}, 1, False),
])
def test_auto_microbatch_needs_fsdp1(edit, fsdp_version, fires):
    assert bool(_found(edit, H200_SET, "FP8031", fsdp_version)) is fires


def test_version_rules_stay_quiet_when_nothing_was_probed():
    """LintContext without a snapshot: rules that judge what is installed say nothing."""
    config = _merge(TE_LN_MLP, {"device_train_microbatch_size": "auto", "fsdp_config": {}})
    assert not {"FP8030", "FP8031"} & {f.rule for f in lint_config(config)}


def test_one_line_per_upstream_crash_with_file_line_key_source_and_fix(tmp_path, monkeypatch,
                                                                        capsys):
    """`foundry-fp8 lint` on the H200's versions: each crash is one row naming the line and key,
    the upstream file and line that raises, and the fix below it."""
    from foundry_fp8.cli import main
    from foundry_fp8.lint import cli

    monkeypatch.setattr(cli, "gather_snapshot", lambda **_: H200_SET)
    path = _write(tmp_path, _merge(TE_LN_MLP, {"device_train_microbatch_size": "auto"}))
    assert main(["lint", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    lines = path.read_text().splitlines()
    rows = {row.split()[2]: (row, fix) for row, fix in pairwise(out) if " FP803" in row}
    assert set(rows) == {"FP8030", "FP8031"}
    for rule, key, upstream, fix in (
            ("FP8030", "model.ffn_config.ffn_type",
             "llmfoundry/models/utils/param_init_fns.py:466", "fuse_ln_mlp: true"),
            ("FP8031", "device_train_microbatch_size",
             "composer/trainer/_patch_pytorch.py:30", "to an integer")):
        row, fix_line = rows[rule]
        where, severity, _, named = row.split()[:4]
        line, column = map(int, where.split(":"))
        assert (severity, named) == ("error", key)
        assert lines[line - 1][column - 1:].startswith(key.split(".")[-1] + ":")
        assert upstream in row and "NameError" in row
        assert fix_line.strip().startswith("fix: ") and fix in fix_line


# -- omegaconf's `???`, MPT sizes, MCLI shapes, folder walks, autoresume with W&B offline -----

def _entry_of(tmp_path: Path, text: str, name: str = "train.yaml", **kwargs: Any) -> dict:
    path = tmp_path / name
    path.write_text(text)
    entry = lint_file(path, 1, NO_FLASH, **kwargs)
    assert entry["error"] is None, entry["error"]
    return entry


def _hits(entry: dict) -> list[tuple[str, str, int | None, str]]:
    return [(f["rule"], f["key"], f["line"], f["severity"]) for f in entry["findings"]
            if f["rule"] not in ("FP8029", "FP8038")]  # flash-attn's absence is this machine's;
    # the snippets are fragments, which FP8038 tells to give every key `llmfoundry train` needs


@pytest.mark.parametrize(("text", "expected"), [
    # before: exit 0 (LLM-Foundry raises MissingMandatoryValue for each)
    ("precision: fp32\nmax_duration: ???\nseed: ???\n",
     [("FP8036", "max_duration", 2, "error"), ("FP8036", "seed", 3, "error")]),
    ("run_name: '???'\n", [("FP8036", "run_name", 1, "error")]),  # quoted: omegaconf's too
    # before: FP8011 "no precision '???'": one finding, the mandatory one
    ("precision: ???\n", [("FP8036", "precision", 1, "error")]),
    # before: FP8035 "the string '???'"; MPT gets the text and raises
    ("model:\n  name: mpt_causal_lm\n  loss_fn: torch_crossentropy\n  d_model: ???\n",
     [("FP8036", "model.d_model", 4, "error")]),
    # LLM-Foundry hands the logger the text: a warning
    ("loggers:\n  wandb:\n    project: ???\n",
     [("FP8036", "loggers.wandb.project", 3, "warning")]),
    ("code_paths:\n- ???\n", [("FP8036", "code_paths.0", 2, "warning")]),
    ("variables:\n  later: ???\nprecision: fp32\n", []),  # never read: fine
])
def test_omegaconfs_mandatory_value_is_one_finding_at_its_key(tmp_path, text, expected):
    assert _hits(_entry_of(tmp_path, text)) == expected


def test_a_mandatory_value_in_eval_and_mcli_configs(tmp_path):
    eval_text = ("models:\n- model_name: m\n  model: {name: hf_causal_lm}\n  tokenizer: {name: "
                 "gpt2}\nmax_seq_len: ???\ndevice_eval_batch_size: 4\n")
    assert _hits(_entry_of(tmp_path, eval_text)) == [("FP8036", "max_seq_len", 5, "error")]
    mcli = ("name: x\nimage: y\ncommand: composer train.py /mnt/config/parameters.yaml\n"
            "parameters:\n  max_duration: ???\n")
    assert _hits(_entry_of(tmp_path, mcli)) == [
        ("FP8036", "parameters.max_duration", 5, "error")]


@pytest.mark.parametrize(("model", "key", "snippet"), [
    # before: no finding (QA: MPTConfig raises ZeroDivisionError / ValueError for each)
    ("d_model: 64\n  n_heads: 0", "model.n_heads", "n_heads is 0"),
    ("d_model: .nan\n  n_heads: 4", "model.d_model", "d_model is nan"),
    ("d_model: 1e400\n  n_heads: 4", "model.d_model", "d_model is inf"),
    ("d_model: 64\n  n_heads: .nan", "model.n_heads", "n_heads is nan"),
    ("d_model: 64\n  n_heads: 4.0", "model.n_heads", "written without a decimal point"),
    ("d_model: 64\n  n_layers: 2.5", "model.n_layers", "n_layers is 2.5"),
    ("d_model: 64\n  vocab_size: -1", "model.vocab_size", "of at least 0"),
    ("d_model: 64\n  max_seq_len: 2.5", "model.max_seq_len", "max_seq_len is 2.5"),
    ("d_model: 64\n  expansion_ratio: .nan", "model.expansion_ratio", "a finite number"),
    ("d_model: 64\n  head_dim: 16.0", "model.head_dim", "(or null)"),
    ("d_model: 64\n  ffn_config:\n    ffn_hidden_size: -256", "model.ffn_config.ffn_hidden_size",
     "of at least 0"),
    ("d_model: 64\n  attn_config:\n    attn_type: grouped_query_attention\n    kv_n_heads: 0",
     "model.attn_config.kv_n_heads", "of at least 1"),
    ("d_model: null", "model.d_model", "d_model is null"),
])
def test_mpt_sizes_mpt_refuses_are_fp8035(tmp_path, model, key, snippet):
    text = f"model:\n  name: mpt_causal_lm\n  loss_fn: torch_crossentropy\n  {model}\n"
    entry = _entry_of(tmp_path, text)
    hits = [f for f in entry["findings"] if f["rule"] == "FP8035"]
    assert [f["key"] for f in hits] == [key], entry["findings"]
    assert snippet in hits[0]["message"] and "FP8032" not in _rules(entry)


@pytest.mark.parametrize("model", [
    "max_seq_len: 64.0",  # MPTConfig converts an integral float
    "n_layers: 0",  # builds (no block)
    "head_dim: null\n  vocab_size: 0",
    "expansion_ratio: 2.5",
    "ffn_config:\n    ffn_hidden_size: 256\n  expansion_ratio: .nan",  # ignored then
])
def test_mpt_sizes_mpt_builds_are_not_fp8035(tmp_path, model):
    text = ("model:\n  name: mpt_causal_lm\n  loss_fn: torch_crossentropy\n  d_model: 64\n"
            f"  {model}\n")
    entry = _entry_of(tmp_path, text)
    assert "FP8035" not in _rules(entry), entry["findings"]


MCLI_HEAD = "name: x\nimage: y\ncommand: composer train.py /mnt/config/parameters.yaml\n"


@pytest.mark.parametrize(("parameters", "line"), [
    ("parameters: 5\n", 4), ("parameters: [1, 2]\n", 4), ("parameters: null\n", 4),
    ("", 3),  # none at all: the command reads a file MCLI never writes
    # before: linted as an empty train config, exit 0; LLM-Foundry's train raises KeyError
    # 'global_train_batch_size' (LLM-Foundry's own mcli/mcli-1b.yaml has `parameters: {}`, but
    # its command trains from another file)
    ("parameters: {}\n", 4),
])
def test_an_mcli_config_training_from_parameters_it_does_not_give_is_fp8401(tmp_path,
                                                                          parameters, line):
    """Before: skipped, exit 0 ('without a `parameters:` mapping: nothing to lint')."""
    entry = _entry_of(tmp_path, MCLI_HEAD + parameters, "run.yaml")
    assert _hits(entry) == [("FP8401", "parameters" if parameters else "command", line, "error")]
    assert "skipped" not in entry and exit_code({"files": [entry]}) == 1


@pytest.mark.parametrize("parameters", ["", "parameters: {}\n"])
def test_an_mcli_config_whose_command_takes_no_config_is_still_skipped(tmp_path, parameters):
    entry = _entry_of(tmp_path, "name: x\nimage: y\ncommand: python convert.py\n" + parameters,
                      "run.yaml")
    assert entry["findings"] == [] and "nothing to lint" in entry["skipped"]


def test_an_empty_parameters_mapping_is_refused_by_llmfoundrys_train_too():
    """FP8401's reference for `parameters: {}`: what MCLI writes, as LLM-Foundry's train reads."""
    from llmfoundry.command_utils.train import train
    from omegaconf import OmegaConf

    with pytest.raises(KeyError, match="global_train_batch_size"):
        train(OmegaConf.create({}))


@pytest.mark.parametrize("text", [
    "run_name: foo\nprecison: amp_fp8\n",  # before: taken for MCLI (run_name), skipped
    "run_name: foo\nmetadata: {a: 1}\nprecison: amp_fp8\n",
])
def test_a_train_config_with_run_name_is_not_taken_for_mcli(tmp_path, text):
    entry = _entry_of(tmp_path, text)
    assert "skipped" not in entry
    assert ("FP8009", "precison", text.count("\n"), "error") in _hits(entry)


def _yaml_at(folder: Path, name: str = "bad.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("precision: amp_bf16\nprecison: amp_fp8\n")
    return path


def test_a_folder_walk_skips_hidden_virtualenv_and_cache_folders(tmp_path):
    """Before: `foundry-fp8 lint .` linted .venv's and .github's YAML (exit 2 on third-party
    files). A folder or file named on the command line is still linted."""
    root = tmp_path / "repo"
    mine = _yaml_at(root / "yamls", "train.yaml")
    for skipped in (".github/workflows", ".venv/lib", "env/lib", "__pycache__", "node_modules/x"):
        _yaml_at(root / skipped)
    (root / "env" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (root / ".pre-commit-hooks.yaml").write_text("- id: x\n")
    result = _lint(str(root), "--format", "json")
    assert [e["path"] for e in json.loads(result.stdout)["files"]] == [str(mine)], result.stdout
    named = _lint(str(root / ".venv"), str(root / ".pre-commit-hooks.yaml"), "--format", "json")
    assert len(json.loads(named.stdout)["files"]) == 2


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symlinks here")
def test_a_folder_walk_follows_symlinked_folders_once(tmp_path):
    """Before: a folder holding only a link to a folder of configs was 'no .yaml or .yml
    file'. Links are followed; a link back up (a loop) or to a folder walked already ends
    there, so each config is linted once."""
    shared = tmp_path / "shared"
    config = _yaml_at(shared)
    root = tmp_path / "root"
    root.mkdir()
    (root / "configs").symlink_to(shared, target_is_directory=True)
    (root / "again").symlink_to(shared, target_is_directory=True)
    (shared / "loop").symlink_to(tmp_path, target_is_directory=True)
    result = _lint(str(root), "--format", "json")
    paths = [e["path"] for e in json.loads(result.stdout)["files"]]
    assert len(paths) == 1 and Path(paths[0]).resolve() == config.resolve(), paths
    assert result.returncode == 1


WANDB_OFFLINE = ("run_name: r\nsave_folder: ckpt\nautoresume: true\nloggers:\n  wandb:\n"
                 "    project: p\n    init_kwargs:\n      mode: {mode}\n")


@pytest.mark.parametrize(("mode", "context", "expected"), [
    ("offline", None, [("FP8037", "autoresume", 3, "error")]),  # QA's s4b_ar.yaml
    ("disabled", None, [("FP8037", "autoresume", 3, "error")]),
    ("online", None, []),
    ("online", "offline", []),  # wandb.init's own mode wins over WANDB_MODE
    ("null", "offline", [("FP8037", "autoresume", 3, "error")]),
    ("null", None, []),
])
def test_autoresume_with_wandb_not_online_is_fp8037(tmp_path, mode, context, expected):
    entry = _entry_of(tmp_path, WANDB_OFFLINE.format(mode=mode), wandb_mode=context)
    assert _hits(entry) == expected


def test_autoresume_with_wandb_offline_and_sharded_checkpoints_is_a_warning(tmp_path):
    text = WANDB_OFFLINE.format(mode="offline") + "fsdp_config:\n  state_dict_type: sharded\n"
    assert _hits(_entry_of(tmp_path, text)) == [("FP8037", "autoresume", 3, "warning")]


def test_the_cli_reads_wandb_mode_from_the_environment(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("run_name: r\nsave_folder: ckpt\nautoresume: true\nloggers:\n  wandb: {}\n")
    assert _lint(str(path), env={"WANDB_MODE": "offline"}).returncode == 1
    assert _lint(str(path), env={"WANDB_MODE": "online"}).returncode == 0


# -- QA round: offload, reentrant wording, eval's FSDP, FP8028 in the CLI, key positions ----------

def test_offload_alone_recomputes_nothing_so_fp8013_is_quiet_and_fp8003_still_asserts():
    """Composer wraps blocks in torch's offload_wrapper for activation_cpu_offload alone: it
    runs each forward once (checkpoint_wrapper twice), so te_swap's emulated layers are never
    recomputed outside FP8 (FP8013, an error for it before); Composer still asserts
    te_checkpoint_wrapper's non-reentrant setting in that branch (FP8003)."""
    import inspect

    import torch
    from composer.distributed import dist_strategy
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
        offload_wrapper,
    )

    class Counted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.calls = torch.nn.Linear(4, 4), 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.linear(x).relu()

    calls = []
    for wrap in (offload_wrapper, lambda m: checkpoint_wrapper(
            m, checkpoint_impl=CheckpointImpl.NO_REENTRANT)):
        module = Counted()
        wrap(module)(torch.randn(2, 4, requires_grad=True)).sum().backward()
        calls.append(module.calls)
    assert calls == [1, 2] and dist_strategy.offload_wrapper is offload_wrapper
    source = inspect.getsource(dist_strategy.prepare_fsdp_module)
    branch = source.index("if activation_checkpointing or activation_cpu_offload:")
    assert branch < source.index("TE checkpoint only works with non-reentrant") < \
        source.index("offload_wrapper(")
    offload = {"fsdp_config": {"activation_cpu_offload": True, "activation_checkpointing": False}}
    assert "FP8013" not in _lint_dict(_merge(EMULATE, offload))
    assert "FP8013" in _lint_dict(_merge(EMULATE, CKPT))
    wrapper = _merge(FP8_TE, offload, {"fsdp_config": {"te_checkpoint_wrapper": True}})
    assert _lint_dict(wrapper)["FP8003"] == "error"


def test_fp8003_says_whether_the_config_set_reentrant():
    """Before: 'Composer defaults activation_checkpointing_reentrant to true' also where the
    config wrote true itself (fc_type in mapping form: LLM-Foundry does not flip it)."""
    from omegaconf import OmegaConf

    def message(*edits: dict) -> str:
        cfg = OmegaConf.to_container(OmegaConf.merge(*(OmegaConf.create(e) for e in (
            BASE, FP8_TE, CKPT, {"fsdp_config": {"te_checkpoint_wrapper": True}}, *edits))),
            resolve=True)
        [found] = [f.message for f in lint_config(cfg) if f.rule == "FP8003"]
        return found

    assert "Composer defaults activation_checkpointing_reentrant to true" in message()
    explicit = message({"model": {"fc_type": {"name": "te"}},
                        "fsdp_config": {"activation_checkpointing_reentrant": True}})
    assert "this config sets activation_checkpointing_reentrant: true" in explicit
    assert "defaults" not in explicit


EVAL_FSDP = """\
max_seq_len: 1024
device_eval_batch_size: 4
precision: amp_fp8
models:
- model_name: mpt-125m-fp8
  model:
    name: mpt_causal_lm
    d_model: 768
    n_heads: 12
    n_layers: 12
    fc_type: te
    loss_fn: torch_crossentropy
  tokenizer:
    name: EleutherAI/gpt-neox-20b
  load_path: ./checkpoints/latest-rank0.pt
fsdp_config:
  sharding_strategy: FULL_SHARD
  activation_checkpointing: true
  te_checkpoint_wrapper: true
icl_tasks: eval/yamls/tasks_v0.3.yaml
"""


def test_fp8003_judges_eval_configs(tmp_path):
    """eval builds Composer's Trainer with the config's fsdp_config and precision
    (test_lint_known: test_llmfoundry_eval_hands_fsdp_config_and_precision_to_composers_trainer)
    and flips nothing: before, no finding."""
    path = tmp_path / "eval.yaml"
    path.write_text(EVAL_FSDP)
    entry = lint_file(path, 1, NO_FLASH)
    [hit] = [f for f in entry["findings"] if f["rule"] == "FP8003"]
    assert (hit["key"], hit["severity"], hit["line"]) == (
        "fsdp_config.te_checkpoint_wrapper", "error",
        EVAL_FSDP.splitlines().index("  te_checkpoint_wrapper: true") + 1)
    path.write_text(EVAL_FSDP + "  activation_checkpointing_reentrant: false\n")
    assert "FP8003" not in _rules(lint_file(path, 1, NO_FLASH))


def test_fp8028_says_what_it_knows_of_the_machine(tmp_path):
    """The CLI never probes the GPU, and before said amp_fp8 'needs TransformerEngine and an FP8
    GPU' as an error whatever the machine; now it says both outcomes. fp8_lint (run scope)
    judges its own machine."""
    config = _merge({"precision": "amp_fp8"}, EMULATE)
    h100 = Snapshot(python="3", capability=(9, 0), te="2.8.0")
    cpu = Snapshot(python="3")
    file_hit, = [f for f in lint_file(_write(tmp_path, config), 1, h100)["findings"]
                 if f["rule"] == "FP8028"]
    assert file_hit["severity"] == "error"
    assert "Composer raises on a machine without TransformerEngine" in file_hit["message"]
    assert "on one with them amp_fp8 does nothing for emulated layers" in file_hit["message"]
    for snapshot, severity, said in ((h100, "warning", "this machine has TransformerEngine"),
                                     (cpu, "error", "this machine lacks TransformerEngine")):
        [hit] = [f for f in lint_config(config, LintContext(scope="run", snapshot=snapshot))
                 if f.rule == "FP8028"]
        assert hit.severity == severity and said in hit.message


def test_a_top_level_key_with_a_dot_is_its_own_key(tmp_path):
    """Before: `"model.d_model"` (a top-level key) and model's d_model shared the path
    model.d_model, so FP8009 pointed at model's d_model line."""
    path = tmp_path / "dots.yaml"
    path.write_text(BASE.replace("  d_model: 2048\n", "  d_model: '2048'\n")
                    + '"model.d_model": 1024\n')
    found = {(f["rule"], f["key"], f["line"]) for f in lint_file(path, 1, NO_FLASH)["findings"]}
    model_line = BASE.splitlines().index("  d_model: 2048") + 1
    assert found == {("FP8009", '"model.d_model"', BASE_LINES + 1),
                     ("FP8035", "model.d_model", model_line)}


def test_merged_keys_sit_where_their_anchor_writes_them(tmp_path):
    """Before: a finding on a key a merge key (`<<: *anchor`) brings in pointed at the mapping's
    own line (`fsdp_config:`); the mapping's own keys still win over merged ones."""
    path = tmp_path / "merge.yaml"
    text = BASE.replace("fsdp_config:\n  sharding_strategy: FULL_SHARD\n  activation_checkpointing: "
                        "false\n", "")
    text = text.replace("variables:\n", "variables:\n  fsdp: &fsdp\n    te_checkpoint_wrapper: "
                        "true\n    activation_checkpointing: false\n    mixed_precison: PURE\n")
    text = text.replace("precision: amp_bf16", "precision: amp_fp8").replace(
        "  loss_fn: torch_crossentropy\n", "  loss_fn: torch_crossentropy\n  fc_type: te\n")
    text += "fsdp_config:\n  <<: *fsdp\n  activation_checkpointing: true\n"
    path.write_text(text)
    lines = text.splitlines()
    found = {f["rule"]: (f["key"], f["line"]) for f in lint_file(path, 1, NO_FLASH)["findings"]}
    assert found["FP8003"] == ("fsdp_config.te_checkpoint_wrapper",
                               lines.index("    te_checkpoint_wrapper: true") + 1)
    assert found["FP8010"] == ("fsdp_config.mixed_precison",
                               lines.index("    mixed_precison: PURE") + 1)
    positions = load_config(path).positions  # the explicit key, not the merged one
    assert positions["fsdp_config.activation_checkpointing"] == (len(lines), 3)


# -- keys written in the wrong section: where they belong, not a spelling guess ---------------

def _messages(edit: dict, rule: str) -> dict[str, str]:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(BASE), OmegaConf.create(edit)),
                                 resolve=True)
    return {f.key: f.message for f in lint_config(cfg, LintContext()) if f.rule == rule}


@pytest.mark.parametrize(("edit", "rule", "key", "home", "not_said"), [
    # before: "did you mean `tp_config`?", "`fsdp_config`?", "`activation_checkpointing`?"
    ({"attn_config": {"attn_impl": "flash"}}, "FP8009", "attn_config", "`model:`", "tp_config"),
    ({"fp8_config": {"fp8_format": "HYBRID"}}, "FP8009", "fp8_config",
     "`algorithms.te_swap.fp8_recipe`", "did you mean"),
    ({"fsdp_config": {"activation_checkpointing_target": ["mptblock"]}}, "FP8010",
     "fsdp_config.activation_checkpointing_target", "`model:`", "did you mean"),
    ({"fc_type": "te"}, "FP8009", "fc_type", "`model:`", "did you mean"),
    ({"fp8_recipe": {"margin": 1}}, "FP8009", "fp8_recipe", "`algorithms.te_swap:`",
     "did you mean"),
    ({"model": {"attn_impl": "flash"}}, "FP8024", "model.attn_impl", "`model.attn_config:`",
     "did you mean"),
    ({"model": {"attn_config": {"ffn_type": "mptglu"}}}, "FP8042", "model.attn_config.ffn_type",
     "`model.ffn_config:`", "did you mean"),
    ({"fsdp_config": {"precision": "amp_bf16"}}, "FP8010", "fsdp_config.precision",
     "top level", "did you mean"),
])
def test_a_key_in_the_wrong_section_is_told_where_it_belongs(edit, rule, key, home, not_said):
    message = _messages(edit, rule)[key]
    assert "belong" in message and home in message and not_said not in message, message


def test_misspellings_still_get_a_spelling_guess():
    assert "did you mean `precision`?" in _messages({"precison": "amp_fp8"}, "FP8009")["precison"]
    message = _messages({"fsdp_config": {"activation_checkpointing_reentrnt": False}}, "FP8010")
    assert "did you mean `activation_checkpointing_reentrant`?" in message[
        "fsdp_config.activation_checkpointing_reentrnt"]


def test_fp8001_names_a_top_level_fc_type_instead_of_saying_there_is_none():
    """Before: 'no fc_type: te' for a file that writes `fc_type: te`, at the top level."""
    message = _messages({"precision": "amp_fp8", "fc_type": "te"}, "FP8001")["precision"]
    assert "top-level `fc_type`" in message and "`model:`" in message
    assert "no fc_type: te" not in message
    plain = _messages({"precision": "amp_fp8"}, "FP8001")["precision"]
    assert "no fc_type: te" in plain


def test_an_eval_models_key_is_told_its_home_from_where_it_is_written():
    from foundry_fp8.lint.rules.model import model_key_hits

    model = {"name": "mpt_causal_lm", "attn_impl": "flash", "precision": "amp_bf16"}
    hits = {h.key: h for h in model_key_hits(model, "models.0.model")}
    assert "belongs under `models.0.model.attn_config:`" in hits["models.0.model.attn_impl"].message
    assert hits["models.0.model.attn_impl"].fix == "move `attn_impl` under `models.0.model.attn_config:`"
    assert "belongs" not in hits["models.0.model.precision"].message  # a train config's top level


@pytest.mark.parametrize(("edit", "key", "said"), [
    ({"algorithms": {"fp8_lint": {}}}, "algorithms.fp8_lint", "`fp8_lint` is not an algorithm"),
    ({"callbacks": {"te_swap": {}}}, "callbacks.te_swap", "`te_swap` is not a callback"),
])
def test_an_entry_in_the_wrong_section_is_named_with_its_article(edit, key, said):
    """Before: '`fp8_lint` is not a algorithm'."""
    assert _messages(edit, "FP8026")[key].startswith(said)
