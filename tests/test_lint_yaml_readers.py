"""The linter reads each file with the YAML reader of the tool that will read it: MCLI and
Accelerate use yaml.safe_load (PyYAML's pure-Python reader), which refuses tabs between tokens
that libyaml (the linter's fast reader, and omegaconf 2.4's) accepts; a character YAML refuses
is named at its line and column."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from mcli.utils.utils_yaml import load_yaml
from omegaconf import OmegaConf

MCLI = """name: mpt-125m-fp8
image: mosaicml/llm-foundry:2.7.0_cu128-latest
compute:
  gpus: 8
command: composer train/train.py /mnt/config/parameters.yaml
parameters:
  max_seq_len: 2048
  model:
    name: mpt_causal_lm
    d_model: 768
"""
ACCELERATE = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
mixed_precision: fp8
num_processes: 8
"""


def _lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(("text", "old", "line", "column"), [
    (MCLI, "  gpus: 8", 4, 8),            # in the MCLI part
    (MCLI, "    d_model: 768", 10, 13),  # in the parameters MCLI writes out
    (ACCELERATE, "mixed_precision: fp8", 3, 17),
])
def test_a_tab_yaml_safe_load_refuses_exits_2_at_its_line(tmp_path, text, old, line, column):
    path = tmp_path / "config.yaml"
    path.write_text(text.replace(old, old.replace(": ", ":\t")))
    reader = load_config_from_file if text is ACCELERATE else load_yaml
    with pytest.raises(yaml.scanner.ScannerError) as refused:  # the tool's own reader
        reader(str(path))
    mark = refused.value.problem_mark
    assert (mark.line + 1, mark.column + 1) == (line, column)
    done = _lint(path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    error, = [e for e in done.stderr.splitlines() if e.startswith("error: ")]
    assert error.startswith(f"error: {path}:{line}:{column}: yaml.safe_load"), error
    assert "a tab is not allowed between YAML tokens" in error


def test_a_tab_inside_quotes_is_read_by_both(tmp_path):
    path = tmp_path / "mcli.yaml"
    path.write_text(MCLI.replace("name: mpt-125m-fp8", 'name: "mpt\t125m"'))
    assert load_yaml(str(path))["name"] == "mpt\t125m"
    assert _lint(path).returncode == 0


@pytest.mark.parametrize("character", ["\x00", "\x01", "\x7f", "\x9b"])
def test_a_character_yaml_refuses_is_named_at_its_line(tmp_path, character):
    path = tmp_path / "train.yaml"
    path.write_text(MCLI.replace("mpt_causal_lm", f"mpt_causal_lm{character}"))
    with pytest.raises(yaml.reader.ReaderError) as refused:  # the pure reader's index
        yaml.safe_load(path.read_text())
    before = path.read_text()[:refused.value.position]
    line, column = before.count("\n") + 1, len(before.rpartition("\n")[2]) + 1
    assert (line, column) == (9, 24)
    done = _lint(path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    error, = [e for e in done.stderr.splitlines() if e.startswith("error: ")]
    assert error.startswith(f"error: {path}:{line}:{column}: not valid YAML: character "
                            f"{ord(character):#06x}"), error


#: LLM-Foundry's train path on YAML files, in a child process (clear_resolver is global):
#: train_from_yaml's load, then train's make_dataclass_and_log_config; the error type of each.
FOUNDRY_TRAIN = """
import sys
from omegaconf import OmegaConf as om
from llmfoundry.command_utils.train import TRAIN_CONFIG_KEYS, TrainConfig
from llmfoundry.utils.config_utils import make_dataclass_and_log_config
om.clear_resolver('oc.env')
for path in sys.argv[1:]:
    try:
        make_dataclass_and_log_config(om.load(path), TrainConfig, TRAIN_CONFIG_KEYS,
                                      transforms='all')
        print('OK')
    except Exception as e:
        print(type(e).__name__)
"""

TRAIN = """max_seq_len: 128
model: {name: mpt_causal_lm, d_model: 64, n_heads: 4, n_layers: 2, loss_fn: torch_crossentropy}
tokenizer: {name: gpt2}
optimizer: {name: decoupled_adamw, lr: 1.0e-4}
scheduler: {name: constant_with_warmup, t_warmup: 0ba}
train_loader:
  name: text
  dataset:
    local: LOCAL
    split: train
    max_seq_len: 128
max_duration: 10ba
global_train_batch_size: 8
device_train_microbatch_size: 8
"""


def test_oc_env_is_fp8017_whatever_the_linting_machines_environment(tmp_path):
    """An escaped `\\${oc.env:X}` resolves to its text, which LLM-Foundry's dataclass step
    resolves again (om.structured): it fails as the plain one does. The linter says FP8017 for
    each, with or without X set where it runs (it resolved the escaped one with omegaconf's
    oc.env, exiting 2 where X is unset)."""
    paths = []
    for index, local in enumerate(["\\${oc.env:FP8_TEST_DATA}", "${oc.env:FP8_TEST_DATA}",
                                   "/data/${oc.env:FP8_TEST_DATA}/c4"]):
        paths.append(tmp_path / f"train{index}.yaml")
        paths[-1].write_text(TRAIN.replace("LOCAL", local))
    env = {k: v for k, v in os.environ.items() if k != "FP8_TEST_DATA"}
    foundry = subprocess.run([sys.executable, "-c", FOUNDRY_TRAIN, *map(str, paths)],
                             capture_output=True, text=True, timeout=600, check=True, env=env)
    assert foundry.stdout.split() == ["UnsupportedInterpolationType"] * 3, foundry.stdout
    for value in (None, "/data"):
        done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", "--format",
                               "json", *map(str, paths)], capture_output=True, text=True,
                              timeout=60, check=False,
                              env=env if value is None else {**env, "FP8_TEST_DATA": value})
        assert done.returncode == 1, done.stdout
        for entry in json.loads(done.stdout)["files"]:
            assert entry["error"] is None, entry
            assert [(f["rule"], f["key"], f["line"]) for f in entry["findings"]
                    if f["rule"] == "FP8017"] == [("FP8017", "train_loader.dataset.local", 9)]


def test_an_escaped_interpolation_is_resolved_again_as_llm_foundry_does(tmp_path):
    """`\\${x}` resolves to the text `${x}`, which make_dataclass_and_log_config's om.structured
    resolves again: LLM-Foundry fails on a missing key there and takes a present one; the
    linter said nothing of the missing one."""
    missing, present = tmp_path / "missing.yaml", tmp_path / "present.yaml"
    base = TRAIN.replace("LOCAL", "/data").replace("max_duration: 10ba", "max_duration: 10ba\n"
                                                   "variables: {tag: a}\nrun_name: run-RUN")
    missing.write_text(base.replace("RUN", "\\${variables.nope}"))
    present.write_text(base.replace("RUN", "\\${variables.tag}"))
    foundry = subprocess.run([sys.executable, "-c", FOUNDRY_TRAIN, str(missing), str(present)],
                             capture_output=True, text=True, timeout=600, check=True)
    assert foundry.stdout.split() == ["InterpolationKeyError", "OK"], foundry.stdout
    done = _lint(missing)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    error, = [e for e in done.stderr.splitlines() if e.startswith("error: ")]
    assert error.startswith(f"error: {missing}:14: cannot resolve key run_name: Interpolation "
                            "key 'variables.nope' not found (once resolved"), error
    assert _lint(present).returncode == 0


@pytest.mark.parametrize(("text", "key", "where"), [
    # `<<: *base` naming another file's anchor: YAML anchors do not cross files
    ("max_seq_len: 8\nmodel:\n  <<: *base_model\n  n_layers: 2\n", " in a merge key (<<)",
     "no &base_model anchor before it in this file"),
    ("max_seq_len: 8\nmodel: *base_model\n_base: &base_model\n  n_layers: 2\n",
     " at key model", "its anchor &base_model comes later, at line 3"),
])
def test_an_undefined_alias_is_named_with_its_key_and_anchor(tmp_path, text, key, where):
    """QA (session 19): libyaml said only "found undefined alias" at a line and column; PyYAML's
    own reader names the alias, which the line must name too, with the key holding it."""
    with pytest.raises(yaml.composer.ComposerError) as pure:
        yaml.load(text, Loader=yaml.SafeLoader)
    assert pure.value.problem == "found undefined alias 'base_model'"
    path = tmp_path / "train.yaml"
    path.write_text(text)
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    mark = pure.value.problem_mark
    assert done.stderr.splitlines() == [
        f"error: {path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: found undefined alias "
        f"*base_model{key}: {where}" + (": an anchor must come before its aliases" if "later"
                                        in where else " (anchors do not reach across files)")]


@pytest.mark.parametrize("text", [MCLI + "---\nname: second\n", "precision: amp_fp8\n---\n"
                                  "precision: amp_bf16\n"])
def test_a_file_of_two_documents_is_refused_at_the_second_as_its_readers_do(tmp_path, text):
    """QA (session 19): the line said only "but found another document". MCLI's reader and
    omegaconf (LLM-Foundry's) both refuse a second document; a leading `---` is one document."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(yaml.YAMLError):
        load_yaml(str(path)) if text.startswith(MCLI) else OmegaConf.load(path)
    done = _lint(path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    line = text[:text.index("\n---\n")].count("\n") + 2
    assert done.stderr.splitlines() == [
        f"error: {path}:{line}:1: not valid YAML: expected a single document in the stream, but a "
        "second document (after `---`) starts here: omegaconf, LLM-Foundry's reader, and "
        "yaml.safe_load, MCLI's and Accelerate's, read one document per file; put each config "
        "in its own file"]
    path.write_text("---\n" + text.partition("\n---\n")[0] + "\n")
    assert _lint(path).returncode in (0, 1)
