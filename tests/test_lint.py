"""`foundry-fp8 lint`: each rule fires on a broken config and stays quiet on a clean one, findings
carry the original YAML line, and bad files exit 2 with one line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foundry_fp8.lint.rules import lint_config

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
fsdp_config:
  sharding_strategy: FULL_SHARD
  activation_checkpointing: false
"""

CASES = {  # rule -> (edit that triggers it, key it must name)
    "FP8001": ({"precision": "amp_fp8"}, "precision"),
    "FP8002": ({"precision": "amp_fp8", "model": {"fc_type": "te"},
                "fsdp_config": {"activation_checkpointing": True}},
               "fsdp_config.activation_checkpointing"),
    "FP8003": ({"fsdp_config": {"te_checkpoint_wrapper": True}}, "fsdp_config.te_checkpoint_wrapper"),
    "FP8004": ({"model": {"ffn_config": {"ffn_type": "te_ln_mlp", "ffn_act_fn": {"name": "gelu"}}}},
               "model.ffn_config.ffn_act_fn"),
    "FP8005": ({"precision": "amp_fp8", "model": {"fc_type": "te", "d_model": 2040}}, "model.d_model"),
    "FP8006": ({"precision": "amp_fp8", "model": {"fc_type": "te"},
                "device_train_microbatch_size": 3, "variables": {"seq": 2045}},
               "device_train_microbatch_size"),
    "FP8007": ({"precision_config": {"amax_history_len": 1024}}, "precision_config"),
    "FP8008": ({"algorithms": {"te_swap": {"fp8_recipe": {"fp8_format": "E5M2"}}}},
               "algorithms.te_swap.fp8_recipe.fp8_format"),
}


def _write(tmp_path: Path, edit: dict) -> Path:
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.create(BASE), OmegaConf.create(edit))
    path = tmp_path / "train.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    return path


def _lint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", *args],
                          capture_output=True, text=True)


def test_clean_config_has_no_findings(tmp_path):
    result = _lint(str(_write(tmp_path, {})), "--format", "json")
    assert result.returncode == 0, result.stdout
    assert json.loads(result.stdout)["files"][0]["findings"] == []


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_fires_with_its_key_and_line(tmp_path, rule):
    edit, key = CASES[rule]
    path = _write(tmp_path, edit)
    result = _lint(str(path), "--format", "json")
    assert result.returncode == 1, result.stdout
    findings = json.loads(result.stdout)["files"][0]["findings"]
    hit = [f for f in findings if f["rule"] == rule]
    assert hit and hit[0]["key"] == key and hit[0]["fix"]
    leaf = key.split(".")[-1]
    assert path.read_text().splitlines()[hit[0]["line"] - 1].strip().startswith(f"{leaf}:")


def test_our_yamls_lint_clean():
    result = _lint(str(REPO / "yamls"))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("text", "where"), [
    ("model:\n  d_model: 64\n   n_heads: 4\n", ":3"),
    ("max_seq_len: ${variables.missing}\n", ":1"),
])
def test_unreadable_files_exit_2_with_one_line(tmp_path, text, where):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = _lint(str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 1 and f"{path}{where}:" in errors[0]


def test_missing_file_exits_2(tmp_path):
    result = _lint(str(tmp_path / "nope.yaml"))
    assert result.returncode == 2 and "nope.yaml" in result.stderr


def test_lint_does_not_import_torch(tmp_path):
    path = _write(tmp_path, {})
    code = textwrap.dedent(f"""
        import sys
        from foundry_fp8.cli import main
        main(["lint", {str(path)!r}])
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_fp8_lint_callback_stops_a_bad_run_before_training():
    from foundry_fp8.composer.lint import FP8Lint

    with pytest.raises(ValueError, match="FP8001 precision"):
        FP8Lint(train_config={"precision": "amp_fp8", "model": {}})
    assert len(FP8Lint(train_config={"precision": "amp_fp8"}, fail_on="never").findings) == 1


_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                       lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_keys = st.sampled_from(["precision", "model", "fsdp_config", "algorithms", "max_seq_len",
                         "device_train_microbatch_size", "precision_config"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=6))
def test_rules_never_crash_on_random_configs(config):
    for finding in lint_config(config):
        assert finding.severity in ("error", "warning", "info")
