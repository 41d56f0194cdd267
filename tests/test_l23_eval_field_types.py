"""An eval config EvalConfig refuses (a field of the wrong type or shape, `models: [null]`, a key
that is not a string, a required key absent) is FP8312 at its line: `llmfoundry eval` stops
before building anything, where the linter said nothing (a structure-aware fuzzer's finding,
session 23). The reference is LLM-Foundry's own eval loader on the same file."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint import known
from foundry_fp8.lint.cli import lint_file
from tests.foundry_train import eval_refusal

pytest.importorskip("llmfoundry")

CONFIG = {"max_seq_len": 128, "device_eval_batch_size": 4,
          "models": [{"model_name": "gpt2", "model": {"name": "hf_causal_lm",
                                                       "pretrained_model_name_or_path": "gpt2"},
                      "tokenizer": {"name": "gpt2"}}],
          "icl_tasks": "eval/yamls/tasks_v0.3.yaml"}

#: YAML texts as a user writes them: each type YAML reads, strings omegaconf converts, and the
#: shapes of sections (lists and mappings with odd items, keys and values).
VALUES = ["null", "true", "maybe", "0", "-1", "1.5", "'3'", "x", "1ba", "[1]", "[a]", "{a: 1}",
          "[{a: 1}]", "[null]", "{1: a}", "{a: [1]}", "{a: null}", "[]", "{}"]


def test_the_tables_are_evalconfigs():
    from llmfoundry.utils.config_utils import EvalConfig
    from omegaconf import MISSING

    def members(hint: typing.Any) -> set[type]:
        return set(typing.get_args(hint)) if typing.get_origin(hint) is typing.Union else {hint}

    fields = dataclasses.fields(EvalConfig)
    assert set(known.EVAL_SECTION_SHAPES) | set(known.EVAL_SCALAR_TYPES) == {f.name for f in fields}
    assert {k: set(v) for k, v in known.EVAL_SCALAR_TYPES.items()} == {
        f.name: members(f.type) for f in fields if f.name not in known.EVAL_SECTION_SHAPES}
    assert set(known.EVAL_REQUIRED_KEYS) == {f.name for f in fields if f.default is MISSING}


def _fp8312(path: Path) -> list[tuple[str, int | None]]:
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert entry["error"] is None
    return [(f["key"], f["line"]) for f in entry["findings"] if f["rule"] == "FP8312"]


def test_a_value_evalconfig_refuses_is_fp8312_at_its_line(tmp_path: Path) -> None:
    wrong, refused = [], []
    path = tmp_path / "eval.yaml"
    for key in sorted(set(known.EVAL_CONFIG_KEYS) - {"precision"}):  # FP8011's
        base = yaml.safe_dump({k: v for k, v in CONFIG.items() if k != key}, sort_keys=False)
        line = len(base.splitlines()) + 1
        # a `models:` that is no list makes no eval config (linted as a train config)
        for value in [v for v in VALUES if key != "models" or v.startswith("[")]:
            path.write_text(f"{base}{key}: {value}\n")
            found = _fp8312(path)
            refused.append(eval_refusal(path) is not None)
            if {at for _, at in found} != ({line} if refused[-1] else set()):
                wrong.append((key, value, found, refused[-1]))
    assert not wrong
    assert any(refused) and not all(refused)  # the base config passes: the value decides


def test_a_required_key_absent_and_a_key_that_is_no_string(tmp_path: Path) -> None:
    path = tmp_path / "eval.yaml"
    for key in known.EVAL_REQUIRED_KEYS[1:]:  # without `models:` a file is no eval config
        path.write_text(yaml.safe_dump({k: v for k, v in CONFIG.items() if k != key}))
        assert eval_refusal(path) is not None
        assert _fp8312(path) == [(key, None)]
    path.write_text(yaml.safe_dump(CONFIG, sort_keys=False) + "1: x\n")
    assert eval_refusal(path) is not None  # make_dataclass_and_log_config asserts str keys
    assert _fp8312(path) == [("1", len(yaml.safe_dump(CONFIG).splitlines()) + 1)]
    # the train.py shape: allow_toplevel_keys makes `models` of the top-level model
    shape = {k: v for k, v in CONFIG.items() if k != "models"} | CONFIG["models"][0]
    path.write_text(yaml.safe_dump(shape))
    assert eval_refusal(path) is None
    assert _fp8312(path) == []


@pytest.mark.parametrize("model", ["null", "3", "'${max_seq_len}'", "[a]"])
def test_a_top_level_model_that_is_no_mapping(tmp_path: Path, model: str) -> None:
    """train.py's shape: allow_toplevel_keys reads `cfg.get('model').get('name')` first."""
    shape = {k: v for k, v in CONFIG.items() if k != "models"} | CONFIG["models"][0]
    text = yaml.safe_dump({k: v for k, v in shape.items() if k != "model"}, sort_keys=False)
    path = tmp_path / "eval.yaml"
    path.write_text(f"{text}model: {model}\n")
    assert isinstance(eval_refusal(path), AttributeError)
    assert _fp8312(path) == [("model", len(text.splitlines()) + 1)]
