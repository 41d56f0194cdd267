"""Each kind of file is read as its own tool reads it (s23 fuzzer findings): Accelerate and MCLI
read theirs with yaml.safe_load, PyYAML's pure-Python reader, which takes what libyaml (omegaconf
2.4's reader, LLM-Foundry's) refuses: a `"\\ud800"` escape, `%YAML 1.3`, a byte-order mark inside
the file. The linter refused those Accelerate and MCLI files as "not valid YAML". And Accelerate
never resolves `${...}`: the linter's bounds on interpolations (there for omegaconf's parser)
refused Accelerate configs and DeepSpeed JSONs holding many `${`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from mcli.utils.utils_yaml import load_yaml
from omegaconf import OmegaConf

from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.load import MAX_DEPTH, MAX_INTERPOLATIONS

ACCELERATE = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
mixed_precision: bf16
num_processes: 8
main_process_ip: 10.0.0.1
"""
MCLI = """name: mpt-125m-fp8
image: mosaicml/llm-foundry:2.7.0_cu128-latest
compute:
  gpus: 8
command: composer train/train.py /mnt/config/parameters.yaml
parameters:
  max_seq_len: 2048
  precision: amp_fp8
"""
TRAIN = "max_seq_len: 2048\nprecision: amp_bf16\n"
#: What yaml.safe_load reads and libyaml refuses, each as a change to a file's text: `key`'s
#: value written with a lone surrogate's escape, or a `%YAML 1.3` directive.
LIBYAML_REFUSES = {
    "surrogate escape": lambda text, key: text.replace(f"{key}:", f'{key}: "\\ud800"  #', 1),
    "YAML 1.3": lambda text, key: "%YAML 1.3\n---\n" + text,
}


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _libyaml_refuses(text: str) -> bool:
    try:
        OmegaConf.create(text)  # omegaconf 2.4: libyaml's CSafeLoader
    except yaml.YAMLError:
        return True
    return False


@pytest.mark.parametrize("change", LIBYAML_REFUSES)
def test_accelerate_config_is_read_as_accelerate_reads_it(tmp_path, change):
    path = _write(tmp_path / "accelerate.yaml",
                  LIBYAML_REFUSES[change](ACCELERATE, "main_process_ip"))
    assert _libyaml_refuses(path.read_text(encoding="utf-8"))
    load_config_from_file(str(path))  # Accelerate's own reader takes it
    entry = lint_file(path)
    assert entry["error"] is None and entry["findings"] == [], entry


def test_a_byte_order_mark_inside_an_accelerate_config_is_its_key_as_accelerate_reads_it(
        tmp_path):
    """yaml.safe_load reads `\\ufeffmixed_precision` as a key, which Accelerate then refuses
    as unknown: the linter names that key (FP8111, line 3) instead of "not valid YAML"."""
    path = _write(tmp_path / "accelerate.yaml",
                  ACCELERATE.replace("mixed_precision", "\ufeffmixed_precision"))
    assert _libyaml_refuses(path.read_text(encoding="utf-8"))
    with pytest.raises(ValueError, match="unknown keys"):
        load_config_from_file(str(path))
    entry = lint_file(path)
    assert entry["error"] is None, entry
    assert [(f["rule"], f["key"], f["line"]) for f in entry["findings"]] == \
        [("FP8111", "\ufeffmixed_precision", 3)]


@pytest.mark.parametrize("change", LIBYAML_REFUSES)
def test_mcli_run_config_is_read_as_mcli_reads_it(tmp_path, change):
    """Outside `parameters`, what MCLI reads is MCLI's alone: its parameters are linted."""
    text = LIBYAML_REFUSES[change](MCLI, "name")
    path = _write(tmp_path / "run.yaml", text)
    assert _libyaml_refuses(text)
    load_yaml(path)  # MCLI's own reader takes it
    entry = lint_file(path)
    assert entry["error"] is None, entry
    assert "FP8001" in {f["rule"] for f in entry["findings"]}  # amp_fp8 with nothing in FP8


def test_mcli_parameters_omegaconf_refuses_are_refused_at_their_line(tmp_path):
    """The parameters MCLI hands the train script are read by omegaconf: a `"\\ud800"` there
    is refused, at its line, as before."""
    path = _write(tmp_path / "run.yaml",
                  MCLI.replace("  precision:", '  run_name: "\\ud800"\n  precision:'))
    load_yaml(path)
    entry = lint_file(path)
    assert entry["error"] is not None and entry["error"].startswith(f"{path}:8:"), entry
    assert "not valid YAML: found invalid Unicode character escape code" in entry["error"]


@pytest.mark.parametrize("change", LIBYAML_REFUSES)
def test_a_train_config_libyaml_refuses_is_still_refused(tmp_path, change):
    path = _write(tmp_path / "train.yaml", LIBYAML_REFUSES[change](TRAIN, "precision"))
    with pytest.raises(yaml.YAMLError):
        OmegaConf.load(path)  # LLM-Foundry's train_from_yaml reads with om.load
    entry = lint_file(path)
    assert entry["error"] is not None and "not valid YAML" in entry["error"], entry


NESTED = "${" * (MAX_DEPTH + 10) + "x" + "}" * (MAX_DEPTH + 10)
MANY = "${a}" * (MAX_INTERPOLATIONS + 1)


def test_interpolation_bounds_do_not_apply_to_accelerate_which_never_resolves(tmp_path):
    """A `${` in an Accelerate value is text to Accelerate (and to DeepSpeed in its JSON)."""
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": "auto",
                                                  "comment": MANY}))
    path = _write(tmp_path / "accelerate.yaml",
                  ACCELERATE.replace("MULTI_GPU", "DEEPSPEED")
                  + f"main_process_ip: '{NESTED}'\nmain_training_function: '{MANY}'\n"
                  + "deepspeed_config:\n  deepspeed_config_file: ds.json\n")
    config = load_config_from_file(str(path))
    assert config.main_training_function == MANY
    entry = lint_file(path)
    assert entry["error"] is None, entry


@pytest.mark.parametrize(("value", "why"), [(NESTED, "nested more than"),
                                            (MANY, f"more than {MAX_INTERPOLATIONS} interp")])
def test_interpolation_bounds_still_apply_where_omegaconf_resolves(tmp_path, value, why):
    for path, text in ((tmp_path / "train.yaml", f"{TRAIN}run_name: '{value}'\n"),
                       (tmp_path / "run.yaml", f"{MCLI}  run_name: '{value}'\n")):
        entry = lint_file(_write(path, text))
        assert entry["error"] is not None and why in entry["error"], entry
