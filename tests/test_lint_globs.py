"""A glob pattern no shell expanded (quoted in a CI step, or `**` in a shell without globstar)
lints what it matches, instead of failing as a missing file; a symlink loop does not make it
walk until ELOOP, and a pattern matching nothing is exit 2, as a missing file is."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

CONFIG = "max_seq_len: 128\nprecision: amp_bf16\n"


def _lint(cwd: Path, *patterns: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", "--format", "json",
                           *patterns], capture_output=True, text=True, timeout=60, check=False,
                          cwd=cwd, env={**os.environ, "PYTHONPATH": str(Path.cwd())})


def test_a_quoted_glob_lints_what_it_matches(tmp_path):
    for name in ("train/a.yaml", "train/mpt/b.yaml", "train/mpt/deep/c.yaml", "train/d.yml",
                 "train/.hidden.yaml", "mcli/e.yaml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(CONFIG)
    done = _lint(tmp_path, "train/**/*.yaml", "mcli/*.yaml")
    linted = [e["path"] for e in json.loads(done.stdout)["files"]]
    # Python's own glob (no links here) is the reference for what the patterns match
    expected = sorted(glob.glob("train/**/*.yaml", root_dir=tmp_path, recursive=True)) + \
        sorted(glob.glob("mcli/*.yaml", root_dir=tmp_path))
    assert linted == expected and len(linted) == 4, (linted, expected)
    assert done.returncode == 0, done.stdout


def test_a_glob_through_a_symlink_loop_ends_and_nothing_matched_is_exit_2(tmp_path):
    (tmp_path / "yamls" / "sub").mkdir(parents=True)
    (tmp_path / "yamls" / "sub" / "a.yaml").write_text(CONFIG)
    (tmp_path / "yamls" / "sub" / "loop").symlink_to(tmp_path / "yamls")
    done = _lint(tmp_path, "yamls/**/*.yaml")
    assert [e["path"] for e in json.loads(done.stdout)["files"]] == ["yamls/sub/a.yaml"]
    done = _lint(tmp_path, "yamls/**/*.yml", "yamls/**/*.yaml")
    entries = json.loads(done.stdout)["files"]
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert entries[0] == {"path": "yamls/**/*.yml", "findings": [],
                          "error": "yamls/**/*.yml: no file matches this pattern"}
