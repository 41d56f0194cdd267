"""`foundry-fp8 lint -` lints the config piped to standard input (`mcli describe ... |`,
`cat x.yaml |`), named `<stdin>` in its one line; a terminal on standard input is refused at
once, not waited on."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

CORPUS = Path(__file__).parent / "lint_corpus"
HANG_GUARD_S = 60


def _lint(*args: str, **streams) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", *args],
                          capture_output=True, timeout=HANG_GUARD_S, check=False, **streams)


def _line_of(text: str, key_text: str) -> int:
    """1-based line of the first line that starts (after indentation) with `key_text`."""
    return next(i for i, line in enumerate(text.splitlines(), 1)
                if line.lstrip().startswith(key_text))


def test_piped_mcli_config_is_linted_at_its_lines() -> None:
    text = (CORPUS / "mcli" / "mcli-typo.yaml").read_text()
    done = _lint("-", "--format", "json", input=text.encode())
    assert done.returncode == 1, done.stderr
    [entry] = json.loads(done.stdout)["files"]
    assert entry["path"] == "<stdin>" and entry["error"] is None
    [finding] = entry["findings"]
    assert (finding["rule"], finding["key"]) == ("FP8009", "parameters.precison")
    assert finding["line"] == _line_of(text, "precison:")


def test_piped_text_is_refused_in_one_line_naming_stdin() -> None:
    done = _lint("-", input=b"a: 1\nb: \xff\n")
    assert done.returncode == 2 and b"Traceback" not in done.stderr
    assert done.stderr.decode().splitlines() == [
        "error: <stdin>:2:4: cannot read: not UTF-8 text (byte 0xff)"]


def test_dash_twice_reads_stdin_once() -> None:
    text = (CORPUS / "train" / "mpt-125m-te-swap.yaml").read_bytes()
    done = _lint("-", "-", "--format", "json", input=text)
    first, second = json.loads(done.stdout)["files"]
    assert first["error"] is None and "more than once" in second["error"]
    assert done.returncode == 2


def test_a_terminal_on_stdin_is_refused_not_waited_on() -> None:
    leader, follower = pty.openpty()
    try:
        done = _lint("-", stdin=follower)
    finally:
        os.close(follower)
        os.close(leader)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.decode().splitlines()
    assert line.startswith("error: <stdin>: standard input is a terminal"), line


def test_piped_json_is_read_as_the_json_file_it_is() -> None:
    """A DeepSpeed JSON read as YAML was a train config with four unknown top-level keys
    (FP8009, exit 1); the corpus' hand-checked verdict for the file is one FP8108 warning."""
    import yaml

    expected = yaml.safe_load((CORPUS / "expected.yaml").read_text())["deepspeed/zero3-auto.json"]
    done = _lint("-", "--format", "json",
                 input=(CORPUS / "deepspeed" / "zero3-auto.json").read_bytes())
    [entry] = json.loads(done.stdout)["files"]
    assert [[f["rule"], f["key"], f["severity"]] for f in entry["findings"]] == expected
    assert done.returncode == 0
