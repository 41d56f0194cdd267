"""Accelerate's own docs' torchao snippet (docs/source/usage_guides/low_precision_training.md)
has no distributed_type: `accelerate launch` refuses the file (FP8114), so FP8120's 'under
distributed_type None Accelerator() raises AttributeError' described a run that never starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file

DOC_AO = """\
mixed_precision: fp8
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: false
  fsdp_version: 2
fp8_config:
  backend: AO
  pad_inner_dim: true
  enable_fsdp_float8_all_gather: true
dynamo_config:
  dynamo_backend: INDUCTOR
  dynamo_use_regional_compilation: true
"""


def _rules(path: Path) -> set[str]:
    return {f["rule"] for f in lint_file(path, 1, Snapshot(python="3.11"))["findings"]}


@pytest.mark.parametrize(
    ("distributed", "refused"),
    [
        ("", True),
        ("distributed_type: null\n", False),
        ("distributed_type: MULTI_GPU\n", False),
    ],
)
def test_a_config_launch_refuses_is_said_once(tmp_path: Path, distributed: str, refused: bool):
    path = tmp_path / "ao.yaml"
    path.write_text(distributed + DOC_AO)
    rules = _rules(path)
    assert ("FP8114" in rules) == refused
    assert ("FP8120" in rules) == (not refused)  # Accelerate 1.8.1 here: AO outside FSDP
    # a null distributed_type loads (Accelerate 1.8.1 load_config_from_file): no FP8114


def test_the_reference_accelerate_refuses_the_file(tmp_path: Path):
    from accelerate.commands.config.config_args import load_config_from_file

    path = tmp_path / "ao.yaml"
    path.write_text(DOC_AO)
    with pytest.raises(ValueError, match="distributed_type"):
        load_config_from_file(str(path))
