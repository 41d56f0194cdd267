"""An MCLI run config's `env_variables` are its run's environment: FSDP_VERSION there makes
Composer run FSDP2 (FP8015), WANDB_MODE there makes W&B offline (FP8037), whatever the shell
that runs the linter holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.rules.mcli import mcli_env

RUN = """\
name: mpt-fp8
image: mosaicml/llm-foundry:2.7.0_cu128-latest
compute: {{gpus: 16}}
{env}command: |
  cd llm-foundry/scripts
  composer train/train.py /mnt/config/parameters.yaml
parameters:
  max_seq_len: 2048
  run_name: mpt-fp8
  autoresume: true
  save_folder: /ckpt/{{run_name}}
  loggers:
    wandb: {{project: fp8}}
  model:
    name: mpt_causal_lm
    d_model: 1024
    n_heads: 16
    n_layers: 8
    expansion_ratio: 4
    max_seq_len: 2048
    vocab_size: 50368
    loss_fn: torch_crossentropy
    attn_config: {{attn_impl: flash}}
  tokenizer: {{name: EleutherAI/gpt-neox-20b}}
  train_loader:
    name: text
    dataset: {{local: /tmp/c4, split: train, shuffle: true, max_seq_len: 2048}}
    drop_last: true
    num_workers: 8
  scheduler: {{name: constant_with_warmup, t_warmup: 10ba}}
  optimizer: {{name: decoupled_adamw, lr: 3.0e-4}}
  algorithms:
    te_swap: {{}}
  max_duration: 100ba
  global_train_batch_size: 256
  device_train_microbatch_size: 8
  precision: amp_fp8
  fsdp_config:
    sharding_strategy: FULL_SHARD
    mixed_precision: PURE
    activation_checkpointing: true
    activation_checkpointing_reentrant: false
    te_checkpoint_wrapper: true
  callbacks:
    fp8_state: {{}}
"""


def rules_at(tmp_path: Path, env: str, fsdp_version: int = 1,
             wandb_mode: str | None = None) -> dict[str, list[str]]:
    path = tmp_path / "run.yaml"
    path.write_text(RUN.format(env=env))
    entry = lint_file(path, fsdp_version=fsdp_version, wandb_mode=wandb_mode)
    assert entry["error"] is None, entry["error"]
    found: dict[str, list[str]] = {}
    for f in entry["findings"]:
        found.setdefault(f["rule"], []).append(f["key"])
    return found


MAPPING = "env_variables:\n  FSDP_VERSION: '2'\n  WANDB_MODE: offline\n"
LIST = ("env_variables:\n- key: FSDP_VERSION\n  value: 2\n"
        "- key: WANDB_MODE\n  value: offline\n")


@pytest.mark.parametrize("env", [MAPPING, LIST])
def test_the_runs_environment_decides(tmp_path: Path, env: str):
    found = rules_at(tmp_path, env)
    assert found.get("FP8015") == ["parameters.fsdp_config.activation_checkpointing",
                                   "parameters.fsdp_config.te_checkpoint_wrapper"]
    assert found.get("FP8037") == ["parameters.autoresume"]


def test_without_env_variables_nothing(tmp_path: Path):
    found = rules_at(tmp_path, "")
    assert "FP8015" not in found and "FP8037" not in found


def test_env_variables_win_over_the_linters_shell(tmp_path: Path):
    env = "env_variables:\n  FSDP_VERSION: '1'\n  WANDB_MODE: online\n"
    found = rules_at(tmp_path, env, fsdp_version=2, wandb_mode="offline")
    assert "FP8015" not in found and "FP8037" not in found


@pytest.mark.parametrize(("data", "expected"), [
    ({"env_variables": {"A": 1, "B": None, "C": [1]}}, {"A": "1", "B": ""}),
    ({"env_variables": [{"key": "A", "value": "x"}, "junk", {"value": "y"}]}, {"A": "x"}),
    ({"env_variables": "A=1"}, {}),
    ({}, {}),
])
def test_mcli_env_shapes(data, expected):
    assert mcli_env(data) == expected


P = "/mnt/config/parameters.yaml"


@pytest.mark.parametrize(("command", "expected"), [
    (f"cd x\nexport FSDP_VERSION=2 A=$HOME\ncomposer train/train.py {P}", {"FSDP_VERSION": "2"}),
    (f"FSDP_VERSION=2 WANDB_MODE=offline composer train/train.py {P} a=1",
     {"FSDP_VERSION": "2", "WANDB_MODE": "offline"}),
    (f"composer train/train.py {P}\nexport FSDP_VERSION=2", {"FSDP_VERSION": "1"}),  # after
    (f"echo FSDP_VERSION=2 && composer train.py {P}", {"FSDP_VERSION": "1"}),  # an argument
    (f"export FSDP_VERSION=$V\ncomposer train.py {P}", {}),  # the run's value, unknown here
    ("export FSDP_VERSION=2", {"FSDP_VERSION": "1"}),  # trains from no parameters file
])
def test_the_commands_exports_over_env_variables(command, expected):
    assert mcli_env({"command": command, "env_variables": {"FSDP_VERSION": "1"}}) == expected


def test_an_exported_fsdp_version_is_fp8015(tmp_path: Path):
    path = tmp_path / "run.yaml"
    path.write_text(RUN.format(env="").replace(
        "  composer train/train.py", "  export FSDP_VERSION=2\n  composer train/train.py"))
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    assert [f["key"] for f in entry["findings"] if f["rule"] == "FP8015"] == \
        ["parameters.fsdp_config.activation_checkpointing",
         "parameters.fsdp_config.te_checkpoint_wrapper"]
