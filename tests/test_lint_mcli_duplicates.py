"""FP8402: a key an MCLI run config gives twice. MCLI's own reader (mcli's load_yaml, installed)
keeps the last copy where omegaconf refuses the file, so the linter warns and judges the kept
value instead of refusing the file (exit 2, 'omegaconf ... refuses it')."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import exit_code, lint_file

RUN = """\
name: fp8-dup
image: mosaicml/llm-foundry:latest
compute:
  gpus: {first}
  gpus: {last}
command: composer train/train.py /mnt/config/parameters.yaml
parameters:
  precision: amp_bf16
  load_path: ./ckpt/latest-sharded-rank{{rank}}
  fsdp_config:
    state_dict_type: sharded
  precision: amp_fp8
"""


def _lint(tmp_path: Path, first: int, last: int) -> tuple[dict, dict]:
    path = tmp_path / "run.yaml"
    path.write_text(RUN.format(first=first, last=last))
    from mcli.utils.utils_yaml import load_yaml

    return lint_file(path, 1, Snapshot(python="3")), load_yaml(path)


@pytest.mark.parametrize(("first", "last"), [(8, 1), (1, 8)])
def test_mcli_keeps_the_last_copy_and_the_linter_judges_it(tmp_path, first, last):
    entry, mcli = _lint(tmp_path, first, last)
    assert mcli["compute"]["gpus"] == last and mcli["parameters"]["precision"] == "amp_fp8"
    assert entry["error"] is None  # before: 'omegaconf ... refuses it: found duplicate key gpus'
    dup = [(f["key"], f["line"], f["severity"]) for f in entry["findings"]
           if f["rule"] == "FP8402"]
    assert dup == [("compute.gpus", 5, "warning"), ("parameters.precision", 12, "warning")]
    # the kept precision (amp_fp8) without TE layers: FP8001; the kept world size decides FP8049
    rules = {f["rule"]: f["severity"] for f in entry["findings"]}
    assert rules["FP8001"] == "error"
    assert rules.get("FP8049") == ("error" if mcli["compute"]["gpus"] == 1 else None)
    assert exit_code({"files": [entry]}) == 1


def test_a_plain_train_yaml_with_a_duplicate_is_still_refused(tmp_path):
    """LLM-Foundry reads a train YAML itself, with omegaconf, which refuses it."""
    from omegaconf import OmegaConf

    path = tmp_path / "train.yaml"
    path.write_text("precision: amp_bf16\nprecision: amp_fp8\n")
    with pytest.raises(Exception, match="duplicate key"):
        OmegaConf.load(path)
    entry = lint_file(path, 1, Snapshot(python="3"))
    assert "found duplicate key precision" in entry["error"]
