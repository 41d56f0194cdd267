"""`foundry-fp8 lint` on a file whose name is not valid UTF-8 (`bad\\xff.yaml` on Linux, where a
name is bytes): SARIF crashed (UnicodeEncodeError, exit 1, read as an error finding) and JSON
wrote the name as `\\udcff`, which strict JSON readers refuse and jq turns into U+FFFD, so no CI
tool could find the file from it."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote_to_bytes, urlsplit

import pytest

#: A warning and nothing worse: exit 0, so a crash (exit 1) cannot pass for the finding.
WARNING_ONLY = Path(__file__).parent / "lint_corpus/train/mpt-350m-fp8-no-fsdp.yaml"
NAME = b"bad\xff.yaml"


def _lint(cwd: Path, path: bytes, fmt: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", path, "--format", fmt],
                          cwd=cwd, capture_output=True, timeout=120)


def _strict(document: bytes) -> dict:
    """The output as a strict reader takes it: UTF-8, and no string holding a lone surrogate
    (Python's json.loads accepts `\\udcff`; RFC 8259 section 8.2 leaves it undefined)."""
    def walk(value: object) -> None:
        if isinstance(value, str):
            value.encode("utf-8")  # raises on a lone surrogate
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    loaded = json.loads(document.decode("utf-8"))
    walk(loaded)
    return loaded


@pytest.fixture
def bad_name(tmp_path: Path) -> Path:
    (tmp_path / os.fsdecode(NAME)).write_bytes(WARNING_ONLY.read_bytes())
    return tmp_path


@pytest.mark.parametrize("absolute", [False, True])
def test_sarif_uri_is_the_names_bytes_percent_encoded(bad_name, absolute):
    path = os.path.join(os.fsencode(bad_name), NAME) if absolute else NAME
    done = _lint(bad_name, path, "sarif")
    assert (done.returncode, done.stderr) == (0, b""), done.stderr[-2000:]
    [result] = _strict(done.stdout)["runs"][0]["results"]
    assert result["ruleId"] == "FP8044"
    uri = result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
    assert uri == ("file://" + os.fsdecode(bad_name) + "/bad%FF.yaml" if absolute
                   else "bad%FF.yaml")
    assert unquote_to_bytes(urlsplit(uri).path) == path  # RFC 3986 2.1: the bytes it names
    assert uri.isascii()


def test_json_path_bytes_name_the_file_and_path_stays_readable(bad_name):
    done = _lint(bad_name, NAME, "json")
    assert (done.returncode, done.stderr) == (0, b""), done.stderr[-2000:]
    [entry] = _strict(done.stdout)["files"]
    assert entry["path"] == "bad\ufffd.yaml"  # what jq showed for `\udcff`, now valid UTF-8
    named = base64.b64decode(entry["path_bytes"])
    assert named == NAME and os.path.isfile(os.path.join(os.fsencode(bad_name), named))
    assert [f["rule"] for f in entry["findings"]] == ["FP8044"]


def test_json_of_a_utf8_name_has_no_path_bytes(tmp_path):
    (tmp_path / "caf\u00e9.yaml").write_bytes(WARNING_ONLY.read_bytes())
    done = _lint(tmp_path, "caf\u00e9.yaml".encode(), "json")
    [entry] = _strict(done.stdout)["files"]
    assert entry["path"] == "caf\u00e9.yaml" and "path_bytes" not in entry


def test_a_missing_file_of_such_a_name_is_one_error_notification(tmp_path):
    """The load error's message names the path too: valid UTF-8 there as well."""
    done = _lint(tmp_path, NAME, "sarif")
    assert done.returncode == 2 and b"Traceback" not in done.stderr, done.stderr[-2000:]
    [note] = _strict(done.stdout)["runs"][0]["invocations"][0]["toolExecutionNotifications"]
    assert "bad\ufffd.yaml" in note["message"]["text"]
    assert note["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "bad%FF.yaml"
