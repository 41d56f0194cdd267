"""FP8126: a `distributed_type` that cannot be an enum member's name in any release (`''`, `1`,
`MULTI GPU`) is an error, as load_config_from_file refuses it (a structure-aware fuzzer found
`distributed_type: !!str` linted with a warning, exit 0). An upper-case name the installed
Accelerate lacks stays a warning (tests/test_lint_accelerate_types.py)."""

from __future__ import annotations

import pytest
import yaml

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file

pytest.importorskip("accelerate")


@pytest.mark.parametrize("value", ["", "1", "MULTI GPU", "_MULTI_GPU", "9GPU", "MULTI-GPU"])
def test_no_members_name_is_an_error(tmp_path, value: str) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE",
                                    "distributed_type": value, "num_processes": 2}))
    with pytest.raises(ValueError, match="is not a valid DistributedType"):
        load_config_from_file(str(path))
    entry = lint_file(path, 1, Snapshot(python="3.11"))
    assert [(f["severity"], f["key"]) for f in entry["findings"] if f["rule"] == "FP8126"] == [
        ("error", "distributed_type")]
