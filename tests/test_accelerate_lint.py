"""Accelerate/DeepSpeed config rules (FP81xx): each triggers at its key and line, and a config
that should not trigger it does not; unreadable files are one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.lint.accelerate import (
    lint_accelerate,
    lint_accelerate_file,
    lint_input,
)
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.registry import rules_of
from foundry_fp8.lint.rules import RULES

ACCELERATE_RULES = rules_of("accelerate")

HEAD = """\
compute_environment: LOCAL_MACHINE
distributed_type: {dist}
mixed_precision: {mp}
"""
GOOD_DS = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}


def write(tmp_path: Path, body: str, dist: str = "MULTI_GPU", mp: str = "fp8",
          deepspeed: dict | str | None = None) -> Path:
    """An Accelerate YAML (HEAD then `body`), and its DeepSpeed JSON ds.json when given."""
    if deepspeed is not None:
        (tmp_path / "ds.json").write_text(deepspeed if isinstance(deepspeed, str)
                                          else json.dumps(deepspeed, indent=2))
    path = tmp_path / "accelerate.yaml"
    path.write_text(HEAD.format(dist=dist, mp=mp) + textwrap.dedent(body))
    return path


def found(path: Path, rule: str) -> list[tuple[str, int, str]]:
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    return [(f["key"], f["line"], f["severity"]) for f in entry["findings"] if f["rule"] == rule]


DS_FILE = """\
deepspeed_config:
  deepspeed_config_file: ds.json
"""


def test_fp16_block_with_fp8(tmp_path):
    path = write(tmp_path, DS_FILE, dist="DEEPSPEED",
                 deepspeed={"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    assert found(path, "FP8101") == [("deepspeed_config.deepspeed_config_file", 5, "error")]
    message = next(f["message"] for f in lint_file(path)["findings"] if f["rule"] == "FP8101")
    assert "ds.json:3" in message and "fp16.enabled" in message
    for ds in (GOOD_DS, {"fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}):
        assert found(write(tmp_path, DS_FILE, dist="DEEPSPEED", deepspeed=ds), "FP8101") == []
    # without fp8 an fp16 DeepSpeed config is nothing of ours
    path = write(tmp_path, DS_FILE, dist="DEEPSPEED", mp="fp16",
                 deepspeed={"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    assert found(path, "FP8101") == []


def test_deepspeed_file_refuses_mixed_precision_and_zero_keys(tmp_path):
    path = write(tmp_path, DS_FILE + "  zero_stage: 3\n", dist="DEEPSPEED", deepspeed=GOOD_DS)
    assert found(path, "FP8102") == [("mixed_precision", 3, "error"),
                                     ("deepspeed_config.zero_stage", 6, "error")]
    inline = "deepspeed_config:\n  zero_stage: 3\n"
    assert found(write(tmp_path, inline, dist="DEEPSPEED"), "FP8102") == []


@pytest.mark.parametrize(("version", "dist", "severity"), [
    ((1, 8, 1), "DEEPSPEED", "error"), ((1, 3, 0), "DEEPSPEED", "error"),
    (None, "DEEPSPEED", "warning"), ((1, 5, 0), "MULTI_GPU", "error"),
])
def test_fp8_from_config_never_reaches_te(version, dist, severity):
    config = {"distributed_type": dist, "mixed_precision": "fp8"}
    findings = [f for f in lint_accelerate(lint_input(config, version=version))
                if f.rule == "FP8103"]
    assert [(f.key, f.severity) for f in findings] == [("mixed_precision", severity)]


@pytest.mark.parametrize(("version", "dist", "mp"), [
    ((1, 11, 0), "DEEPSPEED", "fp8"), ((1, 14, 0), "DEEPSPEED", "fp8"),
    ((1, 8, 1), "MULTI_GPU", "fp8"), ((1, 3, 0), "MULTI_GPU", "fp8"),
    (None, "MULTI_GPU", "fp8"), ((1, 8, 1), "DEEPSPEED", "bf16"),
])
def test_fp8_from_config_reaches_te(version, dist, mp):
    config = {"distributed_type": dist, "mixed_precision": mp}
    assert not [f for f in lint_accelerate(lint_input(config, version=version))
                if f.rule == "FP8103"]


@pytest.mark.parametrize(("installed", "expected"), [
    ("1.10.1", [("mixed_precision", 3, "error")]),  # older than 1.11: FP8 never enabled
    ("1.11.0", []),
    (None, [("mixed_precision", 3, "warning")]),  # version unknown: a warning
])
def test_fp8103_through_the_file_uses_the_installed_accelerate(tmp_path, monkeypatch,
                                                                installed, expected):
    """The file path lints against the installed Accelerate's version, as its distribution
    metadata reports it; the test sets that version, so it holds whatever is installed."""
    from foundry_fp8.lint import accelerate

    real = accelerate.metadata.version

    def version(name: str) -> str:
        if name != "accelerate":
            return real(name)
        if installed is None:
            raise accelerate.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(accelerate.metadata, "version", version)
    path = write(tmp_path, "", dist="DEEPSPEED")
    assert found(path, "FP8103") == expected


RECIPE = """\
fp8_config:
  backend: TE
  fp8_format: E4M3
  amax_history_len: 16
"""


def test_recipe_ignored_under_deepspeed(tmp_path):
    assert found(write(tmp_path, RECIPE, dist="DEEPSPEED"), "FP8104") == [
        ("fp8_config", 4, "warning")]
    assert found(write(tmp_path, RECIPE), "FP8104") == []  # honoured without DeepSpeed
    defaults = "fp8_config:\n  backend: TE\n  fp8_format: HYBRID\n  interval: 1\n  margin: 0\n"
    assert found(write(tmp_path, defaults, dist="DEEPSPEED"), "FP8104") == []
    config = {"distributed_type": "DEEPSPEED", "mixed_precision": "fp8",
              "fp8_config": {"amax_history_len": 16}}
    assert not [f for f in lint_accelerate(lint_input(config, version=(1, 3, 0)))
                if f.rule == "FP8104"]  # 1.0-1.3 runs no FP8 under DeepSpeed at all (FP8103)


def test_fp8_config_keys_accelerate_never_reads(tmp_path):
    body = ("fp8_config:\n  backend: TE\n  amax_history_length: 16\n"
            "  amax_compute_algorithm: max\n  amax_histroy_len: 8\n")
    path = write(tmp_path, body)
    assert found(path, "FP8105") == [("fp8_config.amax_history_length", 6, "warning"),
                                     ("fp8_config.amax_compute_algorithm", 7, "warning"),
                                     ("fp8_config.amax_histroy_len", 8, "warning")]
    fixes = [f["fix"] for f in lint_file(path)["findings"] if f["rule"] == "FP8105"]
    assert fixes[0] == "rename it to amax_history_len"
    assert "amax_history_len" in fixes[2]  # did-you-mean
    assert found(write(tmp_path, RECIPE + "  format: E4M3\n  margin: 1\n"), "FP8105") == []


def test_most_recent_is_replaced_by_max(tmp_path):
    body = "fp8_config:\n  backend: TE\n  amax_compute_algo: most_recent\n"
    assert found(write(tmp_path, body), "FP8106") == [
        ("fp8_config.amax_compute_algo", 6, "warning")]
    assert found(write(tmp_path, body.replace("most_recent", "max")), "FP8106") == []
    msamp = "fp8_config:\n  backend: MSAMP\n  amax_compute_algo: most_recent\n"
    assert found(write(tmp_path, msamp), "FP8106") == []


def test_recipe_values_te_rejects(tmp_path):
    body = ("fp8_config:\n  backend: TE\n  fp8_format: e5m2\n  interval: 2\n"
            "  override_linear_precision: [false, false, true]\n  amax_history_len: 0\n")
    assert sorted(found(write(tmp_path, body), "FP8107")) == [
        ("fp8_config.amax_history_len", 9, "error"), ("fp8_config.fp8_format", 6, "error"),
        ("fp8_config.interval", 7, "error"), ("fp8_config.override_linear_precision", 8, "error")]
    # what `accelerate config` writes: defaults that Accelerate never forwards to TE
    written = ("fp8_config:\n  backend: TE\n  fp8_format: HYBRID\n  interval: 1\n"
               "  override_linear_precision: [false, false, false]\n  margin: 0\n")
    assert found(write(tmp_path, written), "FP8107") == []
    assert found(write(tmp_path, "fp8_config:\n  override_linear_precision: false\n"),
                 "FP8107") == []


def test_zero_stage_auto(tmp_path):
    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": "auto"}}
    path = write(tmp_path, DS_FILE, dist="DEEPSPEED", mp="bf16", deepspeed=ds)
    assert found(path, "FP8108") == [("deepspeed_config.deepspeed_config_file", 5, "warning")]
    alone = tmp_path / "ds.json"
    assert found(alone, "FP8108") == [("zero_optimization.stage", 6, "warning")]
    alone.write_text(json.dumps(GOOD_DS, indent=2))
    assert found(alone, "FP8108") == []


def test_deepspeed_file_missing_and_found_relative_to_the_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    body = "deepspeed_config:\n  deepspeed_config_file: nowhere.json\n"
    path = write(tmp_path, body, dist="DEEPSPEED", mp="bf16")
    assert found(path, "FP8109") == [("deepspeed_config.deepspeed_config_file", 5, "warning")]
    path = write(tmp_path, DS_FILE, dist="DEEPSPEED", mp="bf16", deepspeed=GOOD_DS)
    assert found(path, "FP8109") == []


def test_deepspeed_file_under_home_is_not_found_as_accelerate_does_not_expand_it(tmp_path,
                                                                                monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ds.json").write_text(json.dumps(GOOD_DS))
    config = tmp_path / "configs"
    config.mkdir()
    path = write(config, "deepspeed_config:\n  deepspeed_config_file: ~/ds.json\n",
                 dist="DEEPSPEED", mp="bf16")
    assert found(path, "FP8109") == [("deepspeed_config.deepspeed_config_file", 5, "warning")]


def test_train_yamls_are_not_taken_for_accelerate_configs(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("precision: amp_bf16\ndeepspeed_config: {}\nmodel: {d_model: 64}\n")
    assert lint_accelerate_file(path) is None


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", *args],
                          capture_output=True, text=True, check=False)


@pytest.mark.parametrize(("name", "text", "where"), [
    ("bad.json", '{\n  "fp16": {"enabled": true},,\n}\n', "bad.json:2:"),
    ("accelerate.yaml", "distributed_type: DEEPSPEED\nfp8_config: [a\n", "accelerate.yaml:"),
    ("list.json", "[1, 2]\n", "list.json:1:"),
])
def test_unreadable_files_exit_2_with_one_line(tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    done = _cli(str(path))
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and where in errors[0] and "Traceback" not in done.stderr


def test_broken_deepspeed_json_behind_an_accelerate_config_exits_2(tmp_path):
    path = write(tmp_path, DS_FILE, dist="DEEPSPEED", deepspeed='{"fp16": }')
    entry = lint_file(path)
    assert entry["error"].startswith(f"{tmp_path / 'ds.json'}:1:")
    assert _cli(str(path)).returncode == 2


def test_rules_are_registered_with_docs_fields():
    ids = [rule.id for rule in ACCELERATE_RULES]
    assert ids == [f"FP81{n:02d}" for n in range(1, 28)]
    assert not set(ids) & {rule.id for rule in RULES}
    for rule in ACCELERATE_RULES:
        assert rule.summary and rule.rationale and rule.source and rule.fix


# -- FP8111 follows the config class Accelerate picks; FP8115 ------------------------------

#: What `accelerate config` writes for SageMaker (commands/config/sagemaker.py, dumped sorted by
#: SageMakerConfig.to_yaml_file): the shape of accelerate PR #494 and issue #3463.
SAGEMAKER = """\
base_job_name: accelerate-sagemaker-1
compute_environment: AMAZON_SAGEMAKER
debug: false
distributed_type: DATA_PARALLEL
ec2_instance_type: ml.p5.48xlarge
enable_cpu_affinity: false
gpu_ids: all
iam_role_name: accelerate_sagemaker_execution_role
mixed_precision: fp8
num_machines: 1
profile: default
py_version: py310
pytorch_version: 2.3.0
region: us-east-1
transformers_version: 4.41.1
use_cpu: false
"""
#: A multi-GPU config as `accelerate config` writes it (commands/config/cluster.py).
CLUSTER = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
fp8_config:
  backend: MSAMP
  opt_level: O2
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: fp8
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


@pytest.fixture
def installed(monkeypatch):
    """Set the Accelerate version the file path judges against (None: not installed)."""
    from foundry_fp8.lint import accelerate

    def set_version(version: tuple[int, ...] | None) -> None:
        monkeypatch.setattr(accelerate, "installed_accelerate", lambda: version)
    return set_version


def _file(tmp_path: Path, text: str, name: str = "accelerate.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _accelerate_refuses(path: Path) -> bool | None:
    """Does the installed Accelerate's `load_config_from_file` refuse the file (None: not
    installed)? What `accelerate launch --config_file` runs first."""
    try:
        from accelerate.commands.config.config_args import load_config_from_file
    except ImportError:
        return None
    try:
        load_config_from_file(str(path))
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("version", [(1, 8, 1), (1, 14, 0), None])
def test_a_sagemaker_config_is_judged_against_sagemakerconfig(tmp_path, installed, version):
    """Before: 8 false FP8111 errors (region, profile, ec2_instance_type, ...), judged against
    ClusterConfig's keys."""
    installed(version)
    path = _file(tmp_path, SAGEMAKER)
    assert _accelerate_refuses(path) in (False, None)
    assert found(path, "FP8111") == []


def test_a_sagemaker_config_with_cluster_keys_or_distributed_type_no(tmp_path, installed):
    installed((1, 8, 1))
    path = _file(tmp_path, SAGEMAKER + "num_processes: 8\nfp8_config:\n  backend: TE\n")
    assert found(path, "FP8111") == [("num_processes", 17, "error"), ("fp8_config", 18, "error")]
    message = next(f["message"] for f in lint_file(path)["findings"] if f["rule"] == "FP8111")
    assert "SageMaker config has no `num_processes`" in message
    assert _accelerate_refuses(path) in (True, None)
    # the file `accelerate config` writes for "No distributed training" (accelerate #3463)
    path = _file(tmp_path, SAGEMAKER.replace("DATA_PARALLEL", "'NO'"))
    assert found(path, "FP8111") == [("distributed_type", 4, "error")]
    assert _accelerate_refuses(path) in (True, None)
    assert found(path, "FP8113") == []  # it never launches


def test_a_compute_environment_accelerate_does_not_know(tmp_path, installed):
    installed((1, 8, 1))
    path = _file(tmp_path, CLUSTER.replace("LOCAL_MACHINE", "local_machine"))
    assert found(path, "FP8111") == [("compute_environment", 1, "error")]
    message = next(f["message"] for f in lint_file(path)["findings"] if f["rule"] == "FP8111")
    assert "did you mean `LOCAL_MACHINE`?" in message
    assert _accelerate_refuses(path) in (True, None)


@pytest.mark.parametrize(("key", "version", "expected"), [
    ("parallelism_config", (1, 8, 1), "error"), ("parallelism_config", (1, 10, 0), None),
    ("parallelism_config", None, "warning"),
    ("ipex_config", (1, 12, 0), None), ("ipex_config", (1, 13, 0), "error"),
    ("ipex_config", None, "warning"),
    ("tp_config", (1, 3, 0), "error"), ("tp_config", (1, 6, 0), None),
    ("tp_config", (1, 7, 0), "error"),
    ("fsdp_config", None, None),
])
def test_keys_of_some_releases_are_judged_by_the_installed_version(tmp_path, installed, key,
                                                                   version, expected):
    installed(version)
    path = _file(tmp_path, CLUSTER + f"{key}: {{}}\n")
    assert found(path, "FP8111") == ([(key, 21, expected)] if expected else [])
    if expected:
        message = next(f["message"] for f in lint_file(path)["findings"]
                       if f["rule"] == "FP8111")
        assert {"parallelism_config": "from 1.10", "ipex_config": "removed in 1.13",
                "tp_config": "from 1.4, removed in 1.7"}[key] in message


def test_the_key_lists_are_the_installed_accelerates_fields():
    """At the installed version, each class's keys are its dataclass fields plus the legacy
    keys process_config converts."""
    config_args = pytest.importorskip("accelerate.commands.config.config_args")
    from foundry_fp8.lint.accelerate import installed_accelerate
    from foundry_fp8.lint.rules.accelerate import LOCAL, SAGEMAKER, accelerate_keys

    version, legacy = installed_accelerate(), {"fp16", "dynamo_backend"}
    assert accelerate_keys(LOCAL, version) == \
        set(config_args.ClusterConfig.__dataclass_fields__) | legacy
    assert accelerate_keys(SAGEMAKER, version) == \
        set(config_args.SageMakerConfig.__dataclass_fields__) | legacy


@pytest.mark.parametrize(("version", "expected"), [
    ((1, 8, 1), [("fp8_config.backend", 7, "warning")]),
    ((1, 8, 0), [("fp8_config.backend", 7, "warning")]),
    (None, [("fp8_config.backend", 7, "warning")]),
    ((1, 9, 0), []), ((1, 14, 0), []),
    ((1, 3, 0), []),  # FP8RecipeKwargs reads ACCELERATE_FP8_BACKEND
    ((1, 5, 0), []),  # no FP8 from the config at all: FP8103
])
def test_a_backend_that_accelerate_1_8_ignores(tmp_path, installed, version, expected):
    installed(version)
    path = _file(tmp_path, CLUSTER)
    assert found(path, "FP8115") == expected
    if expected:
        message = next(f["message"] for f in lint_file(path)["findings"]
                       if f["rule"] == "FP8115")
        assert "MSAMP" in message and "torchao" in message
        assert ("accelerate 1.8" if version else "Accelerate < 1.9") in message


def test_a_backend_under_deepspeed_or_without_fp8_is_not_fp8115(tmp_path, installed):
    installed((1, 8, 1))
    assert found(_file(tmp_path, CLUSTER.replace("MULTI_GPU", "DEEPSPEED")), "FP8115") == []
    assert found(_file(tmp_path, CLUSTER.replace("mixed_precision: fp8",
                                                 "mixed_precision: bf16")), "FP8115") == []
    assert found(_file(tmp_path, CLUSTER.replace("  backend: MSAMP\n", "")), "FP8115") == []


@pytest.mark.parametrize(("backend", "version", "expected"), [
    ("te", (1, 9, 0), [("fp8_config.backend", 7, "error")]),
    ("msamp", (1, 14, 0), [("fp8_config.backend", 7, "error")]),
    ("transformer_engine", (1, 10, 0), [("fp8_config.backend", 7, "error")]),
    ("te", None, [("fp8_config.backend", 7, "warning")]),
    ("te", (1, 8, 1), []),  # not read at all: FP8115
    ("te", (1, 3, 0), []),  # FP8RecipeKwargs upper-cases it
    ("TE", (1, 9, 0), []), ("AO", (1, 14, 0), []),
])
def test_a_backend_accelerate_1_9_cannot_read(tmp_path, installed, backend, version, expected):
    """`accelerate launch --fp8_backend`'s choices are lower case, FP8BackendType's capitals."""
    installed(version)
    path = _file(tmp_path, CLUSTER.replace("backend: MSAMP", f"backend: {backend}"))
    assert found(path, "FP8116") == expected
    if expected and backend == "te":
        message = next(f["message"] for f in lint_file(path)["findings"]
                       if f["rule"] == "FP8116")
        assert "FP8BackendType('te')" in message and message.endswith("; write TE")


def test_the_backends_are_accelerates_fp8_backend_types():
    """Against the installed Accelerate's enum where it has the release's values (1.8.1 has
    no AO: FP8_BACKENDS is 1.9's, where the rule applies)."""
    from accelerate.utils.dataclasses import FP8BackendType

    from foundry_fp8.lint.rules.accelerate import FP8_BACKENDS

    assert {m.value for m in FP8BackendType} - {"NO"} <= set(FP8_BACKENDS)
    assert "AO" in FP8_BACKENDS and all(b == b.upper() for b in FP8_BACKENDS)


def test_fp8103_recommends_the_accelerate_that_reads_the_backend():
    config = {"distributed_type": "MULTI_GPU", "mixed_precision": "fp8"}
    finding, = [f for f in lint_accelerate(lint_input(config, version=(1, 5, 0)))
                if f.rule == "FP8103"]
    assert "accelerate>=1.9" in finding.fix
    rule, = [r for r in ACCELERATE_RULES if r.id == "FP8103"]
    assert "1.9+ otherwise" in rule.fix


def _ds_file(tmp_path: Path, value: str) -> list[tuple[str, int, str, str]]:
    path = tmp_path / "accelerate.yaml"
    path.write_text(HEAD.format(dist="DEEPSPEED", mp="bf16")
                    + f"deepspeed_config:\n  deepspeed_config_file: {value}\n")
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    return [(f["key"], f["line"], f["severity"], f["message"]) for f in entry["findings"]
            if f["rule"] == "FP8109"]


@pytest.mark.parametrize(("make", "value", "what"), [
    (lambda p: None, "/dev/zero", "is a device"),
    (lambda p: os.mkfifo(p / "ds.json"), "ds.json", "is a FIFO"),
    (lambda p: (p / "ds.json").mkdir(), "ds.json", "is a folder, not a JSON file: "
     "HfDeepSpeedConfig opens it with json.load, which raises IsADirectoryError"),
])
def test_a_deepspeed_config_file_that_is_not_a_file_says_what_it_is(tmp_path, make, value,
                                                                     what):
    """Before: 'not found next to this file or in the current directory' (a warning)."""
    if value == "/dev/zero" and not Path(value).exists():
        pytest.skip("no /dev/zero")
    if what == "is a FIFO" and not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    make(tmp_path)
    (key, line, severity, message), = _ds_file(tmp_path, value)
    assert (key, line, severity) == ("deepspeed_config.deepspeed_config_file", 5, "error")
    assert f"DeepSpeed config {value} {what}" in message, message


@pytest.mark.parametrize(("value", "shown"), [
    ("[ds.json, other.json]", "got list ['ds.json', 'other.json']"),
    ("''", "got an empty string"), ("5", "got int 5"),
])
def test_a_deepspeed_config_file_that_is_not_a_path_is_fp8109(tmp_path, value, shown):
    """Before: no finding (`accelerate launch` exports str() of it, which Accelerate's
    HfDeepSpeedConfig cannot open)."""
    (key, line, severity, message), = _ds_file(tmp_path, value)
    assert (line, severity) == (5, "error") and shown in message, message


def test_deepspeed_config_file_none_is_no_file_as_accelerate_reads_it(tmp_path):
    assert _ds_file(tmp_path, "none") == []  # DeepSpeedPlugin: "none" means no file


def test_a_deepspeed_json_with_a_key_twice_is_fp8117(tmp_path):
    """Before: no finding (json.load keeps the last; DeepSpeed refuses the file)."""
    text = '{\n  "bf16": {"enabled": true},\n  "zero_optimization": {"stage": 2, "stage": 3}\n}\n'
    alone = tmp_path / "ds.json"
    alone.write_text(text)
    assert found(alone, "FP8117") == [("zero_optimization.stage", 3, "error")]
    path = write(tmp_path, DS_FILE, dist="DEEPSPEED", mp="bf16", deepspeed=text)
    assert found(path, "FP8117") == [("deepspeed_config.deepspeed_config_file", 5, "warning")]
    alone.write_text(json.dumps(GOOD_DS, indent=2))
    assert found(alone, "FP8117") == []


@pytest.mark.parametrize(("stage", "flagged"), [
    ("NaN", True), ("4", True), ("-1", True), ("2.5", True), ('"two"', True), ("true", True),
    ("Infinity", True), ("0", False), ("3", False), ("2.0", False), ('"auto"', False),
    ('"2"', False),
])
def test_a_zero_stage_deepspeed_refuses_is_fp8118(tmp_path, stage, flagged):
    """Before: `"stage": NaN` (Python's json reads it) gave no finding."""
    alone = tmp_path / "ds.json"
    alone.write_text('{\n  "zero_optimization": {\n    "stage": ' + stage + "\n  }\n}\n")
    assert found(alone, "FP8118") == ([("zero_optimization.stage", 3, "error")] if flagged
                                      else [])


# -- FP8119: FSDP activation checkpointing recomputes outside Accelerate's FP8 autocast ---------

FSDP_AC = """\
fsdp_config:
  fsdp_activation_checkpointing: {ac}
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_version: {version}
fp8_config:
  backend: {backend}
  fp8_format: HYBRID
num_processes: 8
"""


def test_accelerates_te_autocast_wraps_the_forward_and_not_its_recompute(monkeypatch):
    """FP8119's mechanism with the installed Accelerate's own functions: its TE autocast is a
    wrapper around the model's forward (contextual_fp8_autocast, TE stood in by a flag), and a
    block under torch's non-reentrant checkpoint_wrapper, as Accelerate's FSDP activation
    checkpointing wraps it, runs its recompute in backward with the flag off."""
    import contextlib
    import inspect
    import types
    from types import MethodType

    import torch
    from accelerate import Accelerator
    from accelerate.utils import transformer_engine as accelerate_te
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    active: list[bool] = [False]

    @contextlib.contextmanager
    def fp8_autocast(enabled: bool = True, fp8_recipe: object = None):
        before, active[0] = active[0], enabled
        try:
            yield
        finally:
            active[0] = before

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.fp8_autocast = fp8_autocast
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    monkeypatch.setattr(accelerate_te, "is_transformer_engine_available", lambda: True)

    seen: list[bool] = []

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(active[0])
            return self.linear(x).relu()

    model = torch.nn.Sequential(checkpoint_wrapper(Block(),
                                                   checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    # as apply_fp8_autowrap does, without building TE's recipe
    model.forward = MethodType(accelerate_te.contextual_fp8_autocast(model.forward, None), model)
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert seen == [True, False]  # the forward in FP8, its recompute not
    source = inspect.getsource(Accelerator.prepare_model)
    assert "checkpoint_impl=CheckpointImpl.NO_REENTRANT" in source
    assert "apply_fp8_autowrap(" in source
    config = {"distributed_type": "FSDP", "mixed_precision": "fp8", "fp8_config": {"backend": "TE"},
              "fsdp_config": {"fsdp_activation_checkpointing": True}}
    assert [f.rule for f in lint_accelerate(lint_input(config, version=(1, 14, 0)))
            if f.rule == "FP8119"] == ["FP8119"]


@pytest.mark.parametrize(("ac", "fsdp_version", "backend", "version", "expected"), [
    # before: no finding (QA)
    ("true", 1, "TE", (1, 14, 0), [("fsdp_config.fsdp_activation_checkpointing", 5, "error")]),
    ("true", 2, "TE", (1, 9, 0), []),  # FSDP2 never enters TE's autocast: FP8103
    ("true", 1, "TE", None, [("fsdp_config.fsdp_activation_checkpointing", 5, "error")]),
    ("false", 1, "TE", (1, 14, 0), []),
    ("true", 1, "MSAMP", (1, 14, 0), []),  # not TE
    ("true", 1, "TE", (1, 5, 0), []),  # no FP8 from the config at all: FP8103
])
def test_fsdp_activation_checkpointing_with_te_fp8_is_fp8119(tmp_path, installed, ac,
                                                              fsdp_version, backend, version,
                                                              expected):
    installed(version)
    path = write(tmp_path, FSDP_AC.format(ac=ac, version=fsdp_version, backend=backend),
                 dist="FSDP")
    assert found(path, "FP8119") == expected


# -- `accelerate launch` reads fsdp_config and fp8_config keys with or without their prefix ----

def _launched(path: Path) -> tuple[Any, dict[str, str]]:
    """The installed Accelerate's own reading of a config file: the launcher's arguments after
    `_validate_launch_command` copies the file's sections into them (adding `fsdp_`/`fp8_`
    where a key lacks it), and the ACCELERATE_FP8_* variables `setup_fp8_env` exports."""
    launch = pytest.importorskip("accelerate.commands.launch")
    from accelerate.utils.launch import setup_fp8_env

    args = launch.launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _defaults, _mp = launch._validate_launch_command(args)
    return args, setup_fp8_env(args, {})


FSDP_UNPREFIXED = """\
fsdp_config:
  {ac_key}: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  version: 1
fp8_config:
  backend: TE
num_processes: 8
"""


@pytest.mark.parametrize("ac_key", ["activation_checkpointing", "fsdp_activation_checkpointing"])
def test_fsdp_config_keys_are_read_with_or_without_the_fsdp_prefix(tmp_path, installed, ac_key):
    """Before: `activation_checkpointing: true` (no fsdp_ prefix) gave no FP8119, though the
    launcher reads it as fsdp_activation_checkpointing (commands/launch.py:1051)."""
    installed((1, 14, 0))
    path = write(tmp_path, FSDP_UNPREFIXED.format(ac_key=ac_key), dist="FSDP")
    assert found(path, "FP8119") == [(f"fsdp_config.{ac_key}", 5, "error")]
    args, _env = _launched(path)
    assert args.fsdp_activation_checkpointing is True and args.fsdp_version == 1


def test_a_fsdp_config_key_written_both_ways_is_read_as_the_later_one(tmp_path, installed):
    """The launcher copies the section's keys in order into one argument: the later wins."""
    installed((1, 14, 0))
    both = FSDP_UNPREFIXED.format(ac_key="activation_checkpointing").replace(
        "  version: 1\n", "  version: 1\n  fsdp_activation_checkpointing: false\n")
    path = write(tmp_path, both, dist="FSDP")
    assert found(path, "FP8119") == []
    args, _env = _launched(path)
    assert args.fsdp_activation_checkpointing is False
    flipped = both.replace("true", "@").replace("false", "true").replace("@", "false")
    path = write(tmp_path, flipped, dist="FSDP")
    assert found(path, "FP8119") == [("fsdp_config.fsdp_activation_checkpointing", 8, "error")]
    args, _env = _launched(path)
    assert args.fsdp_activation_checkpointing is True


PREFIXED_FP8 = """\
fp8_config:
  fp8_backend: te
  fp8_format: HYBRID
  fp8_amax_history_len: 16
  fp8_override_linear_precision: (false, false, false)
num_processes: 2
"""


def test_fp8_config_keys_are_read_with_or_without_the_fp8_prefix(tmp_path, installed):
    """Before: every key here was FP8105 "silently dropped", and judged as Accelerate 1.10.1 the
    file got nothing else, though the launcher reads `fp8_backend: te` as --fp8_backend
    (FP8116: FP8BackendType('te') raises) and exports the string's characters as the override
    flags (FP8110)."""
    installed((1, 10, 1))
    path = write(tmp_path, PREFIXED_FP8)
    assert found(path, "FP8105") == []
    assert found(path, "FP8116") == [("fp8_config.fp8_backend", 5, "error")]
    assert found(path, "FP8110") == [("fp8_config.fp8_override_linear_precision", 8, "error")]
    _args, env = _launched(path)
    assert env["ACCELERATE_FP8_BACKEND"] == "te"
    assert env["ACCELERATE_FP8_AMAX_HISTORY_LEN"] == "16"
    assert env["ACCELERATE_FP8_FORMAT"] == "HYBRID"
    assert env["ACCELERATE_FP8_OVERRIDE_FPROP"] == "("


def test_the_fp8_config_names_are_the_variables_the_launcher_exports(tmp_path):
    """Each fp8_config key, prefixed or not, under the name of the ACCELERATE_FP8_<NAME> variable
    the installed launcher exports for it (a misspelled one is exported too, and read by
    nothing: FP8105)."""
    from foundry_fp8.lint.rules.accelerate import launch_settings

    body = ("fp8_config:\n  backend: TE\n  fp8_margin: 1\n  amax_compute_algo: max\n"
            "  fp8_use_autocast_during_eval: true\n  fp8_interval: 2\n  amax_histroy_len: 8\n"
            "num_processes: 2\n")
    path = write(tmp_path, body)
    _args, env = _launched(path)
    config = {"fp8_config": yaml.safe_load(body)["fp8_config"]}
    for s in launch_settings(config, "fp8_config"):
        assert env[f"ACCELERATE_FP8_{s.name.upper()}"] == str(s.value)
    assert found(path, "FP8105") == [("fp8_config.amax_histroy_len", 10, "warning")]


MXFP8 = "fp8_config:\n  backend: TE\n  use_mxfp8_block_scaling: {value}\nnum_processes: 2\n"


@pytest.mark.parametrize("value", ["true", "false", "null"])
def test_mxfp8_flag_dropped_where_terecipekwargs_has_no_field(tmp_path, installed, value):
    """Before: FP8105 took use_mxfp8_block_scaling as read by every release. The installed
    launcher exports it, yet the installed TERecipeKwargs has no such field (1.8.1: it is read
    from 1.11): `true` asks for MXFP8 and gets nothing; `false`/`null` ask for the default."""
    import dataclasses

    from accelerate.utils.dataclasses import TERecipeKwargs

    from foundry_fp8.lint.accelerate import installed_accelerate

    version = installed_accelerate()
    path = write(tmp_path, MXFP8.format(value=value))
    _args, env = _launched(path)
    read = "use_mxfp8_block_scaling" in {f.name for f in dataclasses.fields(TERecipeKwargs)}
    exported = "ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING" in env
    assert exported == (value != "null")
    installed(version)
    dropped = value == "true" and exported and not read
    expected = [("fp8_config.use_mxfp8_block_scaling", 6, "warning")] if dropped else []
    assert found(path, "FP8105") == expected
    if expected:
        message = next(f["message"] for f in lint_file(path)["findings"] if f["rule"] == "FP8105")
        assert f"Accelerate {'.'.join(map(str, version))} does not read it" in message
        assert ">= 1.11" in message and "10.0+" in message
    installed((1, 11, 0))
    assert found(path, "FP8105") == []


# -- FP8120: torchao FP8 that Accelerator() refuses ---------------------------------------------

AO_FSDP = """\
fp8_config:
  backend: {backend}
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
{loading}  fsdp_state_dict_type: SHARDED_STATE_DICT
num_processes: 2
"""
LOADING = "  fsdp_cpu_ram_efficient_loading: {value}\n"


@pytest.mark.parametrize(("backend", "loading", "version", "torchao", "expected"), [
    # before: no finding (QA: Accelerator() raises)
    ("AO", "true", (1, 9, 0), False, [("fsdp_config.fsdp_cpu_ram_efficient_loading", 9, "error")]),
    ("AO", "true", (1, 14, 0), False, [("fsdp_config.fsdp_cpu_ram_efficient_loading", 9, "error")]),
    ("AO", "true", (1, 8, 1), False, [("fsdp_config.fsdp_cpu_ram_efficient_loading", 9, "error")]),
    ("AO", "true", None, False, [("fsdp_config.fsdp_cpu_ram_efficient_loading", 9, "warning")]),
    # not written: `accelerate launch` sets it true
    ("AO", None, (1, 10, 1), False, [("fsdp_config", 6, "error")]),
    ("AO", "false", (1, 14, 0), False, []),
    ("AO", "true", (1, 7, 0), False, []),  # no such check before 1.8 (and no FP8: FP8103)
    ("TE", "true", (1, 14, 0), True, []),  # 1.9+ reads the backend
    ("'NO'", "true", (1, 14, 0), True,  # auto-detect: torchao before TE
     [("fsdp_config.fsdp_cpu_ram_efficient_loading", 9, "warning")]),
    ("'NO'", "true", (1, 14, 0), False, []),
    ("TE", "true", (1, 8, 1), True,  # 1.8 takes torchao whatever the backend
     [("fsdp_config.fsdp_cpu_ram_efficient_loading", 9, "warning")]),
    ("TE", "true", (1, 8, 1), False, []),
])
def test_torchao_with_fsdp_cpu_ram_efficient_loading_is_fp8120(tmp_path, installed, monkeypatch,
                                                               backend, loading, version,
                                                               torchao, expected):
    from foundry_fp8.lint import accelerate

    installed(version)
    monkeypatch.setattr(accelerate, "installed_torchao", lambda: torchao)
    body = AO_FSDP.format(backend=backend,
                          loading=LOADING.format(value=loading) if loading else "")
    path = write(tmp_path, body, dist="FSDP")
    assert found(path, "FP8120") == expected
    if expected and expected[0][2] == "error":
        message = next(f["message"] for f in lint_file(path)["findings"] if f["rule"] == "FP8120")
        assert "torchao with FSDP2 and cpu_ram_efficient_loading is not supported" in message


def test_accelerate_1_8_with_torchao_refuses_fp8_outside_fsdp_too(installed):
    """1.8 reads state.fsdp_plugin for AO whatever the distributed type: AttributeError."""
    config = {"distributed_type": "MULTI_GPU", "mixed_precision": "fp8",
              "fp8_config": {"backend": "AO"}}
    hits = [(f.key, f.severity) for f in lint_accelerate(lint_input(config, version=(1, 8, 1)))
            if f.rule == "FP8120"]
    assert hits == [("distributed_type", "error")]
    for version in ((1, 9, 0), (1, 14, 0)):  # 1.9 tests for FSDP first
        assert not [f for f in lint_accelerate(lint_input(config, version=version))
                    if f.rule == "FP8120"]


def test_the_installed_accelerate_refuses_torchao_as_fp8120_says(tmp_path):
    """The installed Accelerate (1.8.1), torchao stood in by its availability check: Accelerator()
    raises outside FSDP (AttributeError), and its FSDP check reads cpu_ram_efficient_loading,
    which `accelerate launch` sets true unless fsdp_config says false."""
    accelerator = pytest.importorskip("accelerate.accelerator")
    import inspect

    from foundry_fp8.lint.accelerate import installed_accelerate

    if installed_accelerate() is None or installed_accelerate()[:2] != (1, 8):
        pytest.skip("written against Accelerate 1.8")
    source = inspect.getsource(accelerator.Accelerator.__init__)
    assert 'self.fp8_backend == "AO" and self.state.fsdp_plugin.cpu_ram_efficient_loading' \
        in source
    script = ("from unittest import mock\nimport accelerate.accelerator as a\n"
              "import accelerate.state as s\n"
              "with mock.patch.object(a, 'is_torchao_available', lambda: True), "
              "mock.patch.object(s, 'is_fp8_available', lambda: True):\n"
              "    try:\n        a.Accelerator(mixed_precision='fp8')\n"
              "    except AttributeError as e:\n        print('AttributeError', e)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=False)
    assert "AttributeError" in done.stdout and "fsdp_plugin" in done.stdout, done.stderr[-2000:]
    path = write(tmp_path, AO_FSDP.format(backend="AO", loading=""), dist="FSDP")
    args, _env = _launched(path)
    assert args.fsdp_cpu_ram_efficient_loading == "true"


# -- torchao's fp8_config flags (pad_inner_dim, enable_fsdp_float8_all_gather) ------------------

AO_FLAGS = """\
fp8_config:
  backend: AO
  enable_fsdp_float8_all_gather: {gather}
  pad_inner_dim: {pad}
fsdp_config:
  fsdp_version: 2
  fsdp_cpu_ram_efficient_loading: false
num_processes: 2
"""


@pytest.mark.parametrize(("version", "gather", "pad", "expected"), [
    # before: no finding (FP8105 took both as read by every release)
    ((1, 12, 0), "true", "true", [("fp8_config.enable_fsdp_float8_all_gather", 6, "warning"),
                                  ("fp8_config.pad_inner_dim", 7, "warning")]),
    ((1, 8, 1), "false", "yes", [("fp8_config.pad_inner_dim", 7, "warning")]),
    ((1, 12, 0), "false", "null", []),  # what the older release runs anyway
    ((1, 13, 0), "true", "true", []),
    ((1, 14, 0), "false", "true", []),
])
def test_torchao_flags_dropped_before_accelerate_1_13(tmp_path, installed, version, gather, pad,
                                                      expected):
    """`accelerate config` (1.13+) writes enable_fsdp_float8_all_gather and pad_inner_dim for
    backend AO; AORecipeKwargs reads them only from v1.13.0 (src/accelerate/utils/dataclasses.py:
    346-351, PR #3831). Reference: the installed Accelerate's launcher exports them, yet its
    AORecipeKwargs has no such field (1.8.1)."""
    import dataclasses

    from accelerate.utils.dataclasses import AORecipeKwargs

    path = write(tmp_path, AO_FLAGS.format(gather=gather, pad=pad), dist="FSDP")
    _args, env = _launched(path)
    assert env["ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER"] == str(yaml.safe_load(gather))
    fields = {f.name for f in dataclasses.fields(AORecipeKwargs)}
    assert not fields & {"pad_inner_dim", "enable_fsdp_float8_all_gather"}
    installed(version)
    assert found(path, "FP8105") == expected
    for f in lint_file(path)["findings"]:
        if f["rule"] == "FP8105":
            assert "from 1.13" in f["message"] and "accelerate>=1.13" in f["fix"]


@pytest.mark.parametrize(("version", "backend", "torchao", "expected"), [
    # before: no finding (FP8123 read TERecipeKwargs' keys only)
    ((1, 13, 0), "AO", False, [("fp8_config.pad_inner_dim", 7, "error")]),
    (None, "AO", False, [("fp8_config.pad_inner_dim", 7, "warning")]),
    ((1, 14, 0), "'NO'", True, [("fp8_config.pad_inner_dim", 7, "warning")]),  # torchao picked
    ((1, 14, 0), "TE", True, []),  # TERecipeKwargs does not read it
    ((1, 12, 0), "AO", False, []),  # not read at all: FP8105
])
def test_a_torchao_flag_aorecipekwargs_cannot_read_is_fp8123(tmp_path, installed, monkeypatch,
                                                             version, backend, torchao,
                                                             expected):
    """AORecipeKwargs reads its flags with parse_flag_from_env (dataclasses.py:346-351, v1.13.0),
    whose str_to_bool raises on `maybe`. Reference: the installed Accelerate's own
    parse_flag_from_env on what its launcher exports."""
    from accelerate.utils.environment import parse_flag_from_env

    from foundry_fp8.lint import accelerate

    path = write(tmp_path, AO_FLAGS.format(gather="true", pad="maybe").replace(
        "backend: AO", f"backend: {backend}"), dist="FSDP")
    _args, env = _launched(path)
    monkeypatch.setenv("ACCELERATE_FP8_PAD_INNER_DIM", env["ACCELERATE_FP8_PAD_INNER_DIM"])
    with pytest.raises(ValueError, match="invalid truth value"):
        parse_flag_from_env("ACCELERATE_FP8_PAD_INNER_DIM", default=True)
    installed(version)
    monkeypatch.setattr(accelerate, "installed_torchao", lambda: torchao)
    assert found(path, "FP8123") == expected


def test_msamp_under_fsdp_is_refused_at_accelerator_init_whatever_fsdp_version(installed):
    """Before: FP8124 said MS-AMP under FSDP2 trains without FP8 'with no error' and advised
    fsdp_version 1. Reference: the installed Accelerate's own __init__, which raises
    NotImplementedError for backend MSAMP under distributed_type FSDP with no test of
    fsdp_version (accelerator.py:570-578 in v1.8.1, :601-609 in v1.14.0)."""
    import ast
    import inspect

    accelerator = pytest.importorskip("accelerate.accelerator")
    tree = ast.parse(textwrap.dedent(inspect.getsource(accelerator.Accelerator.__init__)))
    guards = [ast.unparse(n.test) for n in ast.walk(tree) if isinstance(n, ast.If)
              and any(isinstance(r, ast.Raise) and "MS-AMP` + `FSDP" in ast.unparse(r)
                      for r in n.body)]
    assert guards == ["self.distributed_type == DistributedType.FSDP"]
    msamp = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "MSAMP" in ast.unparse(n.test)
             and any("MS-AMP` + `FSDP" in ast.unparse(b) for b in n.body)]
    assert msamp and "NotImplementedError" in ast.unparse(msamp[0])

    acc = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
           "mixed_precision": "fp8", "fp8_config": {"backend": "MSAMP"},
           "fsdp_config": {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": False}}
    findings = [f for f in lint_accelerate(lint_input(acc, version=(1, 14, 0)))
                if f.rule == "FP8124"]
    assert [f.key for f in findings] == ["fsdp_config.fsdp_version"]
    assert "NotImplementedError" in findings[0].message and "no error" not in findings[0].message
    assert "fsdp_version: 1" not in findings[0].fix


MXFP8_AMAX = """\
fp8_config:
  amax_compute_algo: {algo}
  amax_history_len: {history}
  backend: TE
  fp8_format: HYBRID
  margin: 0
  use_mxfp8_block_scaling: {mxfp8}
num_processes: 2
"""


@pytest.mark.parametrize(("version", "algo", "history", "mxfp8", "dist", "expected"), [
    # before: no finding (QA, running Accelerate 1.14.0's TERecipeKwargs + apply_fp8_autowrap on
    # what its setup_fp8_env exports: ValueError for max, and for 16)
    ((1, 14, 0), "max", 16, "true", "MULTI_GPU",
     [("fp8_config.amax_compute_algo", 5, "error"), ("fp8_config.amax_history_len", 6, "error")]),
    ((1, 11, 0), "most_recent", 16, "true", "FSDP", [("fp8_config.amax_history_len", 6, "error")]),
    (None, "max", 1024, "true", "NO", [("fp8_config.amax_compute_algo", 5, "warning")]),
    ((1, 14, 0), "most_recent", 1024, "true", "MULTI_GPU", []),  # defaults: not forwarded (ran)
    ((1, 14, 0), "max", 16, "false", "MULTI_GPU", []),  # DelayedScaling takes them (ran)
    ((1, 10, 1), "max", 16, "true", "MULTI_GPU", []),  # flag not read: FP8105
    ((1, 14, 0), "max", 16, "true", "DEEPSPEED", []),  # recipe not from the config: FP8104
])
def test_amax_settings_with_mxfp8_are_fp8125(tmp_path, installed, version, algo, history, mxfp8,
                                             dist, expected):
    """Accelerate's apply_fp8_autowrap raises for an amax_compute_algo or amax_history_len the
    recipe forwards with use_mxfp8_block_scaling on (src/accelerate/utils/transformer_engine.py:
    170-174, v1.11.0-v1.14.0). Reference: the installed launcher exports the values that
    TERecipeKwargs reads, in the shape `accelerate config` writes."""
    path = write(tmp_path, MXFP8_AMAX.format(algo=algo, history=history, mxfp8=mxfp8), dist=dist)
    _args, env = _launched(path)
    assert env["ACCELERATE_FP8_AMAX_COMPUTE_ALGO"] == algo
    assert env["ACCELERATE_FP8_AMAX_HISTORY_LEN"] == str(history)
    installed(version)
    assert found(path, "FP8125") == expected


@pytest.mark.parametrize("history", ['"01024"', '" 1024"', '"+1_024 "', "1024", '" 16"', '"0016"'])
def test_fp8125_compares_amax_history_len_as_accelerate_reads_it(tmp_path, installed,
                                                                 monkeypatch, history):
    """QA s19 (LOW): `amax_history_len: "01024"` (or `" 1024"`) was a false FP8125 error: the
    YAML text was compared with 1024, but TERecipeKwargs int()s the exported text and to_kwargs
    forwards it only where that int differs from its default. Reference: the installed
    Accelerate's own TERecipeKwargs on what its launcher exports (TE's presence faked)."""
    from accelerate.utils import TERecipeKwargs
    from accelerate.utils import dataclasses as acc_dataclasses

    path = write(tmp_path, MXFP8_AMAX.format(algo="most_recent", history=history, mxfp8="true"))
    _args, env = _launched(path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(acc_dataclasses, "is_transformer_engine_available", lambda: True)
    forwarded = "amax_history_len" in TERecipeKwargs().to_kwargs()
    assert forwarded == (history in ('" 16"', '"0016"'))  # the cases' own sense, checked too
    installed((1, 14, 0))
    assert found(path, "FP8125") == ([("fp8_config.amax_history_len", 6, "error")]
                                     if forwarded else [])
