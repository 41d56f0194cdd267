"""A variant that fails is one line on stderr and one markdown row, its error's first line: cut
at 300 characters, the emulated layers' NVTE_BACKWARD_OVERRIDE refusal (383) lost its fix, and
the bench said `... (fix: use ` and nothing after it (QA 23, `NVTE_BACKWARD_OVERRIDE=
high_precision foundry-fp8 bench --tiny`)."""

from __future__ import annotations

import json

from foundry_fp8.cli import main
from foundry_fp8.emulate import backward_override
from foundry_fp8.recipe import FP8Recipe, RecipeError
from foundry_fp8.tools import bench


def _variant_refusing_the_override(variant, config, bar):
    """te_swap variants raise what an emulated layer raises at its first FP8 forward."""
    assert variant.te_swap
    backward_override(FP8Recipe())  # te_swap's default recipe: delayed scaling
    raise AssertionError("NVTE_BACKWARD_OVERRIDE was not refused")


def test_a_failed_variant_keeps_the_fix_its_error_ends_with(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "high_precision")
    try:
        backward_override(FP8Recipe())
    except RecipeError as err:
        whole = f"RecipeError: {err}"
    assert len(whole) > 300 and whole.endswith(
        "(fix: use fp8_recipe: {scaling: current}, or unset NVTE_BACKWARD_OVERRIDE)")
    monkeypatch.setattr(bench, "run_variant", _variant_refusing_the_override)
    assert main(["bench", "--tiny", "--variants", "fp8-te-swap", "--out", str(tmp_path)]) == 1
    [failed] = json.loads((tmp_path / "mpt-tiny-cpu.json").read_text())["failed"]
    assert failed["reason"] == whole
    assert f"| fp8-te-swap | FAILED: {whole} |" in (tmp_path / "mpt-tiny-cpu.md").read_text()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"foundry-fp8 bench: fp8-te-swap failed: {whole}")


def test_a_longer_error_keeps_its_start_and_its_end():
    """A CUDA or compiler error can run to kilobytes on one line: the row stays bounded, and
    what is left out is marked, between what failed and how the message ends."""
    reason = bench.failure_reason(RuntimeError("start " + "x" * 5000 + " the end"))
    assert len(reason) == bench.REASON_CHARS
    assert reason.startswith("RuntimeError: start x") and reason.endswith("x the end")
    assert "..." in reason
