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
    been given; the usage error now names the path and the fix (`./` before it), which then
    lints it (exit 0)."""
    (tmp_path / "-weird.yaml").write_text(CLEAN)
    (tmp_path / "ok.yaml").write_text(CLEAN)

    def lint(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "foundry_fp8", "lint", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)

    done = lint(*argv)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1] == (
        f"foundry-fp8 lint: error: {argparse_says} (-weird.yaml: a path starting with '-' reads "
        "as an option; put ./ before it: ./-weird.yaml)")
    fixed = lint(*argv[:-1], "./" + argv[-1])
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    dashes = lint(*argv[:-1], "--", argv[-1])  # `--` works here too (docs/lint.md says so)
    assert dashes.returncode == 0, dashes.stdout + dashes.stderr


def test_a_dashed_option_value_gets_a_fix_that_works_there(tmp_path):
    """R3-20: `report --out -outdir RUN` was told "put -- before it: -- -outdir", after which
    argparse says "argument --out: expected one argument" again; `./-outdir` works as a value."""
    from foundry_fp8.health.keys import LOSS, layer_key
    from foundry_fp8.jsonl import JsonlSink

    (tmp_path / "-outdir").mkdir()
    sink = JsonlSink(tmp_path / "run" / "metrics.jsonl")
    for step in range(3):
        sink.write(step, {LOSS: 3.0 - step, layer_key("underflow_pct", "weight", "fc"): 0.1})

    def report(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "foundry_fp8", "report", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)

    done = report("--out", "-outdir", "run")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[-1] == (
        "foundry-fp8 report: error: argument --out: expected one argument (-outdir: a path "
        "starting with '-' reads as an option; put ./ before it: ./-outdir)")
    fixed = report("--out", "./-outdir", "run")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert (tmp_path / "-outdir" / "fp8_report.md").is_file()


def test_an_unknown_option_that_names_no_file_gets_no_path_hint(tmp_path):
    done = subprocess.run([sys.executable, "-m", "foundry_fp8", "lint", "x.yaml", "-bogus"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == "foundry-fp8 lint: error: unrecognized arguments: -bogus"


@pytest.mark.parametrize("argv, option", [
    (["report", "run", "--out", "-outdir"], "--out"),
    (["report", "run", "--baseline", "-base"], "--baseline"),
    (["report", "run", "--bas", "-base"], "--baseline"),  # argparse's abbreviation
    (["bench", "--tiny", "--yamls", "-yamls"], "--yamls"),
    (["bench", "--tiny", "--out", "-results"], "--out"),
])
def test_a_dashed_value_of_a_path_option_gets_the_fix_though_nothing_is_there(
        tmp_path, argv, option):
    """D2-21: `report RUN --out -outdir` for an --out to be made said only "argument --out:
    expected one argument": the hint came only for a path that exists. A '-' argument right
    after an option that takes a path is that path, there or not."""
    done = subprocess.run([sys.executable, "-m", "foundry_fp8", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    value = argv[-1]
    assert done.stderr.splitlines()[-1] == (
        f"foundry-fp8 {argv[0]}: error: argument {option}: expected one argument ({value}: a "
        f"path starting with '-' reads as an option; put ./ before it: ./{value})")
    assert not (tmp_path / value).exists()


@pytest.mark.parametrize("argv, argparse_says", [
    (["report", "run", "--out", "--layers", "x"], "argument --out: expected one argument"),
    (["report", "run", "--layers", "-x"], "argument --layers: expected one argument"),
])
def test_an_option_or_a_non_path_value_after_an_option_gets_no_path_hint(tmp_path, argv,
                                                                          argparse_says):
    """--out's value missing before another option, and a '-' value of an option that takes no
    path: no './' hint, which would name an option or a regex as a path."""
    done = subprocess.run([sys.executable, "-m", "foundry_fp8", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == f"foundry-fp8 {argv[0]}: error: {argparse_says}"
