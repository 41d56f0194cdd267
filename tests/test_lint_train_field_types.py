"""TrainConfig's scalar fields (`seed`, `log_to_console`, `max_duration`, `run_name`, ...) holding
a value of a type omegaconf's structured config refuses: `llmfoundry train` stops with a
ValidationError before anything is built, and the linter says so at the key's line (FP8022).
The table of field types is ours (the linter imports no LLM-Foundry); the reference for each
verdict is LLM-Foundry's own train path: omegaconf's load, make_dataclass_and_log_config and
validate_config, on the same file."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from omegaconf.errors import ValidationError

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint import known
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.rules.train import TYPED_ELSEWHERE
from tests.foundry_train import train_refuses

pytest.importorskip("llmfoundry")

CONFIG = {"max_seq_len": 128, "model": {"name": "mpt_causal_lm", "d_model": 128, "n_heads": 4,
                                        "n_layers": 2, "max_seq_len": 128, "vocab_size": 50368},
          "tokenizer": {"name": "gpt2"}, "train_loader": {"name": "text", "dataset": {}},
          "optimizer": {"name": "decoupled_adamw", "lr": 1.0e-4},
          "scheduler": {"name": "constant_with_warmup", "t_warmup": "1ba"},
          "max_duration": "2ba", "global_train_batch_size": 8,
          "device_train_microbatch_size": 8, "precision": "amp_bf16"}

#: YAML texts, as a user writes them: each type YAML reads, and strings omegaconf converts.
VALUES = ["null", "true", "off", "0", "3", "-1", "1.5", "2.0", ".nan", "1e3", "x", "'3'", "'1.5'",
          "'yes'", "1ep", "'1000ba'", "[1]", "{a: 1}", "''", "1_000", "0x10"]


def test_the_field_types_are_trainconfigs():
    from llmfoundry.utils.config_utils import TrainConfig

    def members(hint: typing.Any) -> set[type]:
        return set(typing.get_args(hint)) if typing.get_origin(hint) is typing.Union else {hint}

    scalar = {f.name: members(f.type) for f in dataclasses.fields(TrainConfig)
              if f.name not in known.SECTION_SHAPES}
    assert {k: set(v) for k, v in known.TRAIN_SCALAR_TYPES.items()} == scalar


@pytest.mark.parametrize("key", sorted(set(known.TRAIN_SCALAR_TYPES) - TYPED_ELSEWHERE))
def test_a_field_of_a_type_trainconfig_refuses_is_fp8022_at_its_line(tmp_path: Path,
                                                                     key: str) -> None:
    base = yaml.safe_dump({k: v for k, v in CONFIG.items() if k != key}, sort_keys=False)
    line = len(base.splitlines()) + 1
    wrong, refused = [], []
    for value in VALUES:
        path = tmp_path / "train.yaml"
        path.write_text(f"{base}{key}: {value}\n")
        entry = lint_file(path, 1, Snapshot(python="3.11"))
        assert entry["error"] is None
        found = [(f["key"], f["line"]) for f in entry["findings"] if f["rule"] == "FP8022"]
        refused.append(train_refuses(path, ValidationError))
        if found != ([(key, line)] if refused[-1] else []):
            wrong.append((value, found))
    assert not wrong
    assert any(refused) and not all(refused)  # the base config passes: the value decides
