"""FP8049: a `load_path` naming a sharded checkpoint's folder where Composer will read it as one
file. The reference is Composer's own Trainer loading that folder without FSDP, as
`llmfoundry train` runs it in one process (it drops fsdp_config there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from foundry_fp8.lint.registry import LintContext
from foundry_fp8.lint.rules import lint_config

SHARDED = {"fsdp_config": {"state_dict_type": "sharded"}}


def _sharded_checkpoint(root: Path) -> Path:
    """What a sharded save leaves: the folder of shards and LLM-Foundry's link to it."""
    folder = root / "ep0-ba4"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")
    (folder / "__0_0.distcp").write_bytes(b"")
    link = root / "latest-sharded-rank0"
    link.symlink_to("ep0-ba4")
    return link


def _composer_loads(path: str) -> str:
    """What Composer's Trainer raises loading `path` in one process without FSDP ('' if none)."""
    import torch
    from composer import Trainer
    from composer.models import ComposerClassifier

    model = ComposerClassifier(torch.nn.Linear(2, 2), num_classes=2)
    try:
        Trainer(model=model, load_path=path, device="cpu")
    except Exception as e:  # noqa: BLE001 -- the reference's own verdict, any type
        return type(e).__name__
    return ""


def _fp8049(config: dict, **context: int) -> list[str]:
    return [f.severity for f in lint_config(config, LintContext(**context))
            if f.rule == "FP8049"]


@pytest.mark.parametrize("name", ["latest-sharded-rank0", "ep0-ba4"])
def test_a_sharded_folder_composer_cannot_load_in_one_process_is_named(tmp_path, name):
    link = _sharded_checkpoint(tmp_path)
    path = str(tmp_path / name)
    assert _composer_loads(path) == "IsADirectoryError"
    assert link.resolve() == tmp_path / "ep0-ba4"
    # before: no finding for either, nor for the sharded fsdp_config that one process drops
    assert _fp8049({"load_path": path}) == ["error"]
    # world size unknown: a sharded fsdp_config is written for 2+ GPUs (QA session 19: a
    # warning at every launch gate for every resumed multi-GPU config was noise)
    assert _fp8049({"load_path": path, **SHARDED}) == ["info"]
    assert _fp8049({"load_path": path, **SHARDED}, gpus=1) == ["error"]
    assert _fp8049({"load_path": path, **SHARDED}, gpus=8) == []
    # FSDP2's default state_dict_type is sharded, FSDP1's full
    assert _fp8049({"load_path": path, "fsdp_config": {}}, fsdp_version=2) == ["info"]
    assert _fp8049({"load_path": path, "fsdp_config": {}}, fsdp_version=1) == ["error"]


def test_a_monolithic_checkpoint_file_is_not_named(tmp_path):
    import torch

    path = tmp_path / "ep0-ba4-rank0.pt"
    torch.save({}, path)
    assert _composer_loads(str(path)) != "IsADirectoryError"
    assert _fp8049({"load_path": str(path)}) == []
    # not judged: a remote path, a name that does not say, a path not there
    for other in ("s3://bucket/run/latest-sharded-rank0", str(tmp_path / "ep0-ba4"), ""):
        assert _fp8049({"load_path": other}) == []


def _cli(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", "--format", "json",
                           *map(str, args)], capture_output=True, text=True, timeout=120,
                          check=False)


def _cli_fp8049(*args: str | Path) -> tuple[int, list[tuple[str, str]]]:
    done = _cli(*args)
    [entry] = json.loads(done.stdout)["files"]
    return done.returncode, [(f["severity"], f["message"]) for f in entry["findings"]
                             if f["rule"] == "FP8049"]


def test_gpus_on_the_command_line_makes_a_plain_yaml_precise(tmp_path):
    """`--gpus N` gives a plain YAML the world size an MCLI run config's compute.gpus gives:
    one process loads the sharded folder as one file (Composer's IsADirectoryError, as
    above), 2+ GPUs load it sharded; without it an info says how to tell."""
    link = _sharded_checkpoint(tmp_path)
    assert _composer_loads(str(link)) == "IsADirectoryError"
    plain = tmp_path / "train.yaml"
    plain.write_text(f"load_path: {link}\nfsdp_config:\n  state_dict_type: sharded\n")
    code, found = _cli_fp8049(plain)  # before: the only verdict, whatever the world size
    assert code == 0 and [s for s, _ in found] == ["info"] and "--gpus N" in found[0][1]
    code, found = _cli_fp8049("--gpus", "1", plain)
    assert code == 1 and [s for s, _ in found] == ["error"] and "`--gpus 1`" in found[0][1]
    assert _cli_fp8049("--gpus", "8", plain) == (0, [])
    mcli = tmp_path / "run.yaml"  # the file's own compute.gpus wins over the flag
    mcli.write_text(f"name: r\nimage: i\ncompute:\n  gpus: 1\ncommand: composer train.py "
                    f"/mnt/config/parameters.yaml\nparameters:\n  load_path: {link}\n"
                    "  fsdp_config:\n    state_dict_type: sharded\n")
    code, found = _cli_fp8049("--gpus", "8", mcli)
    assert code == 1 and "`compute.gpus: 1`" in found[0][1]


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_gpus_must_be_a_whole_number_of_at_least_one(value):
    done = _cli("--gpus", value, "x.yaml")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].endswith(
        f"argument --gpus: must be a whole number of GPUs, at least 1, got '{value}'")
