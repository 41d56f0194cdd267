"""An Accelerate config whose `fp8_config` is no mapping (`fp8_config: TE`, a list).

`accelerate launch` (_validate_launch_command) copies a config section's keys into its arguments
only where the section is a dict: any other fp8_config is read by nothing, and the run gets the
default backend and recipe, with no word. Before, the linter read such a section as empty and
said nothing either (FP8105 now says it).

Reference: Accelerate's own launcher on the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundry_fp8.lint.cli import lint_file

HEAD = "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n" \
       "mixed_precision: fp8\n"


def _launch_backend(path: Path) -> object:
    """fp8_backend as `accelerate launch --config_file path` settles it."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    return _validate_launch_command(args)[0].fp8_backend


@pytest.mark.parametrize("fp8_config", ["TE", "[TE]", "{backend: TE}", "null"])
def test_fp8105_says_an_fp8_config_the_launcher_cannot_read(tmp_path, fp8_config):
    path = tmp_path / "accelerate.yaml"
    path.write_text(f"{HEAD}fp8_config: {fp8_config}\n")
    read = _launch_backend(path) == "TE"
    assert read is (fp8_config == "{backend: TE}")
    found = [(f["line"], f["key"]) for f in lint_file(path)["findings"] if f["rule"] == "FP8105"]
    assert found == ([] if read or fp8_config == "null" else [(5, "fp8_config")])
