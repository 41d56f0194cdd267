"""Interpolations that double what they resolve to at each line (`l1: ['${l0}', '${l0}']`,
`s1: ${s0}${s0}`): a file of a few hundred bytes that omegaconf, resolving every reference anew,
took past 60 s (lists) or 5.8 GB before a MemoryError (text) on. Refused before it resolves, at
the line of the first value past the bound; configs that resolve to little still lint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.load import MAX_EXPANDED_NODES, MAX_RESOLVED_CHARS


def _lists(levels: int) -> str:
    lines = ["variables:", "  l0: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"]
    lines += [f"  l{i}: ['${{variables.l{i - 1}}}', '${{variables.l{i - 1}}}']"
              for i in range(1, levels + 1)]
    return "\n".join([*lines, f"max_seq_len: ${{variables.l{levels}}}", ""])


def _texts(levels: int, relative: bool = False) -> str:
    lines = ["variables:", "  s0: " + "a" * 64]
    ref = ".{}" if relative else "variables.{}"
    lines += [f"  s{i}: ${{{ref.format(f's{i - 1}')}}}${{{ref.format(f's{i - 1}')}}}"
              for i in range(1, levels + 1)]
    return "\n".join([*lines, f"run_name: ${{variables.s{levels}}}", ""])


def _error(tmp_path: Path, text: str) -> str | None:
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    return lint_file(path)["error"]


def _resolved_values(text: str) -> int:
    """What omegaconf (LLM-Foundry's reader) resolves `text` to, counted: the reference."""
    def count(value: object) -> int:
        if isinstance(value, dict):
            return 1 + sum(count(v) for v in value.values())
        return 1 + sum(count(v) for v in value) if isinstance(value, list) else 1
    return count(OmegaConf.to_container(OmegaConf.create(text), resolve=True))


@pytest.mark.parametrize("levels", range(7, 13))
def test_the_bound_follows_what_omegaconf_resolves_to(tmp_path, levels):
    """Refused exactly where omegaconf's own resolution (the whole document, counted) passes
    the bound; 30 doublings, which would not resolve within a minute, the same way as 12."""
    refused = _resolved_values(_lists(levels)) > MAX_EXPANDED_NODES
    error = _error(tmp_path, _lists(levels))
    assert (error is not None) is refused
    if refused:  # at the first value past the bound: `variables` (line 1) when no list is
        past = "variables.l11" if levels >= 11 else "variables"
        line = "13:3" if levels >= 11 else "1:1"
        if levels >= 11:
            assert error == _error(tmp_path, _lists(30))
        assert error == (f"{tmp_path / 'bomb.yaml'}:{line}: the interpolations in `{past}` "
                         f"resolve to more than {MAX_EXPANDED_NODES} values (an interpolation "
                         "bomb?); refusing to resolve it")


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_text_that_doubles_is_refused_where_it_passes_the_bound(tmp_path, relative):
    """64 KiB of resolved text lints (omegaconf resolves it); the first value past the bound is
    named at its line, whether the doubling goes on to 40 levels or stops there."""
    text = _texts(10, relative)
    assert len(OmegaConf.to_container(OmegaConf.create(text), resolve=True)["run_name"]) == 65536
    assert _error(tmp_path, text) is None
    past = next(i for i in range(64) if 64 * 2 ** i > MAX_RESOLVED_CHARS)
    for levels in (past, 40):
        error = _error(tmp_path, _texts(levels, relative)) or ""
        assert error == (f"{tmp_path / 'bomb.yaml'}:{past + 2}:3: the interpolations in "
                         f"`variables.s{past}` resolve to a text of more than "
                         f"{MAX_RESOLVED_CHARS} characters (an interpolation bomb?); refusing "
                         "to resolve it"), error


def test_an_escaped_bomb_is_refused_before_the_second_resolution(tmp_path):
    """LLM-Foundry resolves a second time (`\\${x}` becomes `${x}`): that pass is bounded too."""
    lines = ["variables:", "  s0: " + "a" * 64]
    lines += [f"  s{i}: \\${{variables.s{i - 1}}}\\${{variables.s{i - 1}}}" for i in range(1, 41)]
    error = _error(tmp_path, "\n".join([*lines, "run_name: ${variables.s40}", ""])) or ""
    assert "resolve to a text of more than" in error and "bomb.yaml:" in error


def test_the_cli_refuses_a_bomb_in_one_line_quickly(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(_lists(30))
    done = subprocess.run([sys.executable, "-m", "foundry_fp8", "lint", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr + done.stdout
    assert f"{path}:13:3: the interpolations in `variables.l11`" in done.stdout + done.stderr


def test_a_long_chain_of_interpolations_still_resolves(tmp_path):
    """Sizes are counted without recursion: a chain of 3,000 references (omegaconf resolves it)
    is no bomb."""
    text = "variables:\n  v0: 1\n" + "".join(f"  v{i}: ${{variables.v{i - 1}}}\n"
                                          for i in range(1, 3000))
    assert _error(tmp_path, text + "max_seq_len: ${variables.v2999}\n") is None


def test_a_bomb_the_overrides_build_is_refused_naming_an_override(tmp_path):
    """`--override` items merge before resolution, as LLM-Foundry merges its command line."""
    path = tmp_path / "train.yaml"
    path.write_text("variables:\n  s0: " + "a" * 64 + "\nrun_name: x\n")
    items = [f"variables.s{i}=${{variables.s{i - 1}}}${{variables.s{i - 1}}}" for i in range(1, 41)]
    error = lint_file(path, overrides=[*items, "run_name=${variables.s40}"])["error"] or ""
    assert "the interpolations in `variables.s" in error and "(caused by --override " in error
