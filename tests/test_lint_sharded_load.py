"""FP8049: a `load_path` naming a sharded checkpoint's folder where Composer will read it as one
file. The reference is Composer's own Trainer loading that folder without FSDP, as
`llmfoundry train` runs it in one process (it drops fsdp_config there)."""

from __future__ import annotations

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
    assert _fp8049({"load_path": path, **SHARDED}) == ["warning"]  # world size unknown
    assert _fp8049({"load_path": path, **SHARDED}, gpus=1) == ["error"]
    assert _fp8049({"load_path": path, **SHARDED}, gpus=8) == []
    # FSDP2's default state_dict_type is sharded, FSDP1's full
    assert _fp8049({"load_path": path, "fsdp_config": {}}, fsdp_version=2) == ["warning"]
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
