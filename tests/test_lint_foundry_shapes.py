"""Shapes found in LLM-Foundry's own checkout (scripts/**, mcli/**), written afresh here: a name
kept under `variables:` but read as `${name}`, YAML files that are no train config (an
inference benchmark's, CI's, docs'), and MPT init keys at the model's top level. Each is judged
against what LLM-Foundry's own loader and MPTConfig do with it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.lint.cli import lint_file
from tests.foundry_train import eval_refusal, train_refusal, train_refuses

TRAIN = """\
variables:
  my_seed: 23
max_seq_len: 128
model:
  name: hf_causal_lm
  pretrained_model_name_or_path: gpt2
tokenizer:
  name: gpt2
train_loader:
  name: finetuning
  dataset:
    hf_name: foo/bar
    split: train
    max_seq_len: ${max_seq_len}
optimizer:
  name: decoupled_adamw
  lr: 1.0e-4
scheduler:
  name: constant_with_warmup
  t_warmup: 0ba
max_duration: 1ep
global_train_batch_size: 8
device_train_microbatch_size: 8
seed: SEED
precision: fp32
"""
SEED_LINE = TRAIN.splitlines().index("seed: SEED") + 1


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", *args],
                          capture_output=True, text=True)


# -- a name under `variables:` read as `${name}` ---------------------------------------------

def test_a_variable_read_as_a_top_level_name_is_refused_as_llmfoundry_refuses_it(tmp_path):
    """LLM-Foundry's gpt2-arc-easy--cpu.yaml shape: 0.21 and 0.22 both raise
    InterpolationKeyError resolving it (make_dataclass_and_log_config), so the linter's refusal
    stands, and says where the value is and how to read it. Before: no word of either."""
    from omegaconf.errors import InterpolationKeyError

    path = _write(tmp_path, TRAIN.replace("SEED", "${my_seed}"))
    assert train_refuses(path, InterpolationKeyError)
    entry = lint_file(path)
    assert entry["error"] == (
        f"{path}:{SEED_LINE}: cannot resolve key seed: Interpolation key 'my_seed' not found "
        "(LLM-Foundry's loader raises the same: `my_seed` is under `variables:`, so read it as "
        "`${variables.my_seed}`)")
    result = _cli(str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {entry['error']}"]
    # the fix it names: LLM-Foundry takes it, and so does the linter
    fixed = _write(tmp_path, TRAIN.replace("SEED", "${variables.my_seed}"), "fixed.yaml")
    assert train_refusal(fixed) is None
    assert lint_file(fixed)["error"] is None


def test_a_name_found_nowhere_gets_no_variables_hint(tmp_path):
    from omegaconf.errors import InterpolationKeyError

    path = _write(tmp_path, TRAIN.replace("SEED", "${other_seed}"))
    assert train_refuses(path, InterpolationKeyError)
    error = lint_file(path)["error"]
    assert error == (f"{path}:{SEED_LINE}: cannot resolve key seed: Interpolation key "
                     "'other_seed' not found")


# -- YAML files that are no train config ------------------------------------------------------

#: An inference benchmark's config (scripts/inference/benchmarking/benchmark.py reads such a
#: file with om.load, never train's loader): a `model:` and `max_seq_len` among its own keys.
BENCHMARK = """\
bench_title: tiny
max_seq_len: 256
tokenizer_id: gpt2
model:
  name: mpt_causal_lm
  d_model: 64
  n_heads: 2
  n_layers: 1
  vocab_size: 64
  init_std: 0.02
  tokenizer_name: ${tokenizer_id}
device: cuda
model_dtype: bf16
use_cache: true
batch_sizes: [1, 2]
input_lengths: [64]
output_lengths: [8]
warmup_batches: 2
"""
WORKFLOW = """\
name: tests
on:
  push:
concurrency:
  group: ${{ github.workflow }}-${{ github.ref }}
jobs:
  test:
    runs-on: ubuntu-latest
"""
MKDOCS = "site_name: x\nnav:\n  - Home: index.md\ntheme:\n  name: material\n"
CONDA = "name: env\nchannels: [conda-forge]\ndependencies: [python=3.11]\n"


@pytest.mark.parametrize(("text", "foreign"), [
    (BENCHMARK, 8), (WORKFLOW, 4), (MKDOCS, 3), (CONDA, 3)])
def test_a_yaml_file_that_is_no_train_config_is_skipped(tmp_path, text, foreign):
    """Before: FP8009 errors on each key (FP8038, FP8024 and FP8029 on the benchmark's too), and
    the workflow was a file that could not be linted (exit 2: omegaconf cannot read `${{`).
    LLM-Foundry's train does refuse each as a train config."""
    from omegaconf.errors import GrammarParseError

    path = _write(tmp_path, text)
    try:
        assert train_refusal(path) is not None
    except GrammarParseError:  # the workflow's `${{`: omegaconf's load refuses it first
        assert text == WORKFLOW
    entry = lint_file(path, walked=True)
    assert entry["error"] is None and entry["findings"] == []
    keys = len(yaml.safe_load(text))
    assert entry["skipped"].startswith(f"not an LLM-Foundry train or eval config: {foreign} of "
                                       f"its {keys} top-level keys (")
    assert entry["skipped"].endswith("name the file on the command line to lint it as one)")
    # named, it is linted as what it looks like: a train config LLM-Foundry would refuse
    named = lint_file(path)
    assert "skipped" not in named
    assert named["error"] if text == WORKFLOW else "FP8009" in {
        f["rule"] for f in named["findings"]}


def test_a_folder_lint_skips_them_and_still_reports_the_train_configs(tmp_path):
    """A folder walk skips them; a pattern, as a shell's expansion, names each file."""
    for name, text in (("bench.yaml", BENCHMARK), ("mkdocs.yml", MKDOCS), ("ci.yaml", WORKFLOW)):
        _write(tmp_path, text, name)
    _write(tmp_path, TRAIN.replace("SEED", "${variables.my_seed}") + "precison: fp32\n",
           "train.yaml")
    result = _cli(str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FP8009  precison" in result.stdout
    assert result.stdout.count("FP8") == 1
    assert result.stdout.strip().endswith(
        "4 file(s) linted: 1 error(s), 0 warning(s), 0 info; 3 skipped (nothing to lint)")
    named = _cli(str(tmp_path / "*.y*ml"), "--format", "json")
    assert named.returncode == 2 and "skipped" not in named.stdout


OLD_STYLE_FRAGMENT = """\
max_seq_len: 128
global_seed: 17
data_local: ./c4
seed: ${global_seed}
model:
  name: hf_causal_lm
  pretrained_model_name_or_path: gpt2
"""


@pytest.mark.parametrize(("text", "unknown"), [
    # a whole train config: unknown keys however many, each refused
    (TRAIN.replace("SEED", "${variables.my_seed}")
     + "".join(f"extra_{i}: {i}\n" for i in range(30)), {f"extra_{i}" for i in range(30)}),
    # a fragment: as many of TrainConfig's keys as others
    ("precision: amp_bf16\nprecison: amp_fp8\n", {"precison"}),
    # values kept at the top level and read as `${name}`, as LLM-Foundry's configs did before
    # `variables:`: they count as the config's own
    (OLD_STYLE_FRAGMENT, {"global_seed", "data_local"}),
])
def test_train_configs_and_fragments_are_still_linted(tmp_path, text, unknown):
    path = _write(tmp_path, text)
    error = train_refusal(path)
    assert isinstance(error, (ValueError, KeyError)), error  # a KeyError: a fragment's
    entry = lint_file(path, walked=True)
    assert "skipped" not in entry and entry["error"] is None
    assert {f["key"] for f in entry["findings"] if f["rule"] == "FP8009"} == unknown


def test_an_eval_config_is_never_taken_for_a_foreign_file(tmp_path):
    models = [{"model_name": "m", "model": {"name": "hf_causal_lm",
                                            "pretrained_model_name_or_path": "gpt2"},
               "tokenizer": {"name": "gpt2"}}]
    config = {"max_seq_len": 16, "models": models, "a": 1, "b": 2, "c": 3}
    path = _write(tmp_path, yaml.safe_dump(config))
    entry = lint_file(path, walked=True)
    assert "skipped" not in entry and entry["error"] is None


# -- MPT init keys at the model's top level ----------------------------------------------------

MPT: dict[str, Any] = {"d_model": 64, "n_heads": 4, "n_layers": 1, "max_seq_len": 16,
                       "vocab_size": 64, "attn_config": {"attn_impl": "torch"}}


def test_init_keys_at_the_model_top_level_are_taken_and_ignored():
    """The shape of LLM-Foundry's dbrx-gauntlet eval YAMLs: MPTConfig keeps both as attributes
    and initializes from init_config's defaults (modeling_mpt.py param_init_fn reads
    `init_config` alone), so "MPT ignores" is what happens."""
    from llmfoundry.models.mpt import MPTConfig
    from llmfoundry.models.utils.config_defaults import init_config_defaults

    config = MPTConfig(**MPT, param_init_fn="xavier_uniform_", init_nonlinearity="tanh",
                       init_std=0.5)
    assert config.param_init_fn == "xavier_uniform_" and config.init_nonlinearity == "tanh"
    assert config.init_config == init_config_defaults


def test_init_keys_in_an_eval_config_warn_with_where_they_belong(tmp_path):
    """LLM-Foundry's evaluate takes the file (its loader does not look inside `models`); the
    warnings name `init_config`. Before: no home for either (param_init_fn's fix spoke of a
    closest key the message did not name)."""
    model = {"name": "mpt_causal_lm", **MPT, "loss_fn": "torch_crossentropy",
             "param_init_fn": "kaiming_normal_", "init_nonlinearity": "relu"}
    config = {"max_seq_len": 16, "device_eval_batch_size": 4, "icl_tasks": "tasks.yaml",
              "models": [{"model_name": "m", "model": model, "tokenizer": {"name": "gpt2"}}]}
    path = _write(tmp_path, yaml.safe_dump(config, sort_keys=False))
    assert eval_refusal(path) is None
    entry = lint_file(path)
    found = {f["key"]: f for f in entry["findings"] if f["rule"] == "FP8302"}
    assert set(found) == {"models.0.model.param_init_fn", "models.0.model.init_nonlinearity"}
    assert all(f["severity"] == "warning" for f in found.values())
    scheme = found["models.0.model.param_init_fn"]
    assert scheme["message"].endswith(
        "(MPT takes the init scheme as `models.0.model.init_config.name`)")
    assert scheme["fix"] == "give the scheme as `models.0.model.init_config.name`"
    assert found["models.0.model.init_nonlinearity"]["message"].endswith(
        "(`init_nonlinearity` belongs under `models.0.model.init_config:`)")


def test_init_std_in_a_train_model_belongs_under_init_config(tmp_path):
    """Before: "did you mean `init_device`?"."""
    text = TRAIN.replace("SEED", "${variables.my_seed}").replace(
        "  name: hf_causal_lm\n  pretrained_model_name_or_path: gpt2\n",
        "".join(f"  {k}: {v}\n" for k, v in {"name": "mpt_causal_lm", "d_model": 64,
                                               "n_heads": 4, "n_layers": 1, "vocab_size": 64,
                                               "loss_fn": "torch_crossentropy",
                                               "init_std": 0.02}.items()))
    path = _write(tmp_path, text)
    [hit] = [f for f in lint_file(path)["findings"] if f["rule"] == "FP8024"]
    assert hit["key"] == "model.init_std" and hit["severity"] == "warning"
    assert hit["message"].endswith("(`init_std` belongs under `model.init_config:`)")
    assert hit["fix"] == "move `init_std` under `model.init_config:`"
