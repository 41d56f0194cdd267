"""Arguments as a CI script passes them: a path that starts with '-'."""

from __future__ import annotations

import subprocess
import sys

import pytest

CLEAN = "precision: fp32\nalgorithms:\n  te_swap: {backend: emulate}\n"


@pytest.mark.parametrize("argv, argparse_says", [
    (["-weird.yaml"], "the following arguments are required: paths"),
    (["ok.yaml", "-weird.yaml"], "unrecognized arguments: -weird.yaml"),
])
def test_a_path_starting_with_a_dash_is_named_with_the_fix(tmp_path, argv, argparse_says):
    """QA 20: `foundry-fp8 lint -weird.yaml` said only that paths are required, as if none had
    been given; the usage error now names the path and `--`, which then lints it (exit 0)."""
    (tmp_path / "-weird.yaml").write_text(CLEAN)
    (tmp_path / "ok.yaml").write_text(CLEAN)

    def lint(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "foundry_fp8", "lint", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)

    done = lint(*argv)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1] == (
        f"foundry-fp8 lint: error: {argparse_says} (-weird.yaml: a path starting with '-' reads "
        "as an option; put -- before it: -- -weird.yaml)")
    fixed = lint(*argv[:-1], "--", argv[-1])
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


def test_an_unknown_option_that_names_no_file_gets_no_path_hint(tmp_path):
    done = subprocess.run([sys.executable, "-m", "foundry_fp8", "lint", "x.yaml", "-bogus"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == "foundry-fp8 lint: error: unrecognized arguments: -bogus"
