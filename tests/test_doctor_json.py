"""`foundry-fp8 doctor --format json` as a CI step reads it: the whole of stdout is one JSON
object whose keys are the ones docs/doctor.md promises, with the exit status of text mode."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "doctor.md"


def _documented(after: str, until: str) -> set[str]:
    """The backticked names docs/doctor.md lists between `after` and `until`."""
    text = " ".join(DOC.read_text().split())
    start = text.index(after) + len(after)
    return set(re.findall(r"`(\w+)`", text[start:text.index(until, start)]))


def _doctor(*options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8", "doctor", "--no-te-import",
                           *options], capture_output=True, text=True, timeout=120)


def test_the_json_keys_are_the_documented_ones_and_the_exit_status_is_text_modes() -> None:
    for strict in ((), ("--strict",)):
        done, text = _doctor("--format", "json", *strict), _doctor(*strict)
        report = json.loads(done.stdout)  # all of stdout: nothing else is mixed in
        assert done.returncode == text.returncode == report["exit_code"]
        assert set(report) == {"schema", "environment", "findings", "exit_code", "exit_reason"}
        assert set(report["environment"]) == _documented("`environment` holds", "(`null`")
        for finding in report["findings"]:
            assert set(finding) == _documented("`findings` (each with", "`exit_code`")
