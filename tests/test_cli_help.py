"""Every `foundry-fp8` subcommand and option says what it does and its default in `--help`
(issue 18): read from the parser the CLI really builds, so a new option without help fails."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from foundry_fp8.cli import SUBCOMMANDS, build_parser


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    [group] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(group.choices)


def test_every_subcommand_is_listed_with_what_it_does() -> None:
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "--help"],
                          capture_output=True, text=True, check=True)
    for name, (_, what) in SUBCOMMANDS.items():
        assert name in done.stdout and what.split()[0] in done.stdout


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_every_option_says_what_it_does_and_its_default(command: str) -> None:
    parser = _subparsers()[command]
    assert parser.description
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and len(action.help) > 10, f"{command} {name}: no help"
        required = not action.option_strings and action.nargs in (None, "+")
        if not required:  # an option, or a positional that may be left out
            assert "default" in action.help.lower(), f"{command} {name}: no default in its help"


def test_tiny_data_module_help_says_what_it_builds() -> None:
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.tools.tiny_data", "--help"],
                          capture_output=True, text=True, check=True)
    assert "tokenizer" in done.stdout and "MDS" in done.stdout and "without any download" in done.stdout


@pytest.mark.parametrize(("argv", "usage", "error"), [
    (["lint", "--fromat", "json", "x.yaml"], "usage: foundry-fp8 lint ",
     "foundry-fp8 lint: error: unrecognized arguments: --fromat (did you mean --format?)"),
    (["doctor", "--strct"], "usage: foundry-fp8 doctor ",
     "foundry-fp8 doctor: error: unrecognized arguments: --strct (did you mean --strict?)"),
    (["doctor", "extra"], "usage: foundry-fp8 doctor ",
     "foundry-fp8 doctor: error: unrecognized arguments: extra"),
    (["--frob"], "usage: foundry-fp8 ", "foundry-fp8: error: unrecognized arguments: --frob"),
    (["bench", "--bogus"], "usage: foundry-fp8 bench ",
     "foundry-fp8 bench: error: unrecognized arguments: --bogus"),
], ids=["lint-typo", "doctor-typo", "doctor-positional", "top-level", "nothing-near"])
def test_an_unknown_option_is_refused_by_its_subcommand(argv, usage, error) -> None:
    """QA 17: `foundry-fp8 lint --fromat json x.yaml` printed the top-level usage, which shows
    none of lint's options, and named no near option."""
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0].startswith(usage) and lines[-1] == error, lines


def _exit_statuses(command: str) -> list[tuple[int, str]]:
    """The `exit status:` paragraph of `python -m foundry_fp8 COMMAND --help`: (code, meaning)."""
    import re

    done = subprocess.run([sys.executable, "-m", "foundry_fp8", command, "--help"],
                          capture_output=True, text=True, check=True)
    paragraph = " ".join(done.stdout.partition("exit status:")[2].split())
    return [(int(code), meaning) for code, meaning
            in re.findall(r"(?:^|[,;] )(\d+) (.+?)(?=[,;] \d+ |\.$)", paragraph)]


LINT_ERROR = "precision: amp_fp8\nmodel:\n  name: mpt_causal_lm\n"  # FP8001: no layer in FP8
LINT_WARNINGS = "precision: amp_bf16\nmodel:\n  name: mpt_causal_lm\n"  # FP8038, FP8029 only


@pytest.mark.parametrize(("argv", "word"), [
    (["lint", "error.yaml"], "error finding"),
    (["lint", "warnings.yaml"], "no error finding"),
    (["lint", "missing.yaml"], "cannot be linted"),
    (["doctor", "--no-te-import"], "nothing is broken"),
    (["doctor", "--no-te-import", "--strict"], "--strict"),  # no GPU here: FP8201's warning
    (["report", "missing-run"], "cannot be read"),
    (["tiny-data", "error.yaml"], "file in the way"),
    (["bench", "--tiny", "--yamls", "missing"], "refused before any training"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_help_says_what_each_exit_status_means(argv, word, tmp_path, monkeypatch) -> None:
    """QA 19: no `--help` named an exit status (docs/lint.md and the modules' docstrings did),
    so a CI script's author could not tell lint's findings (1) from a file it could not read
    (2). The status each real run exits with is the one its help gives that meaning."""
    from foundry_fp8.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "error.yaml").write_text(LINT_ERROR)
    (tmp_path / "warnings.yaml").write_text(LINT_WARNINGS)
    code = main(argv)
    statuses = _exit_statuses(argv[0])
    assert any(c == code and word in meaning for c, meaning in statuses), (code, statuses)
    assert {130, 141} <= {c for c, _ in statuses}
