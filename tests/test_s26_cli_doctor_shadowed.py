"""`foundry-fp8 doctor` where a `torch` folder on PYTHONPATH shadows the installed torch (a
source tree, a stray copy): Python imports that one, but the doctor read the installed
distribution's version and the shadow's (missing) torch/version.py, and said `torch 2.7.0
(CUDA none: CPU build)`, on a GPU machine the cause of a wrong "built without CUDA" finding."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from foundry_fp8.doctor import _short
from foundry_fp8.environment import _shadowing


def test_a_torch_folder_on_pythonpath_is_named_not_called_a_cpu_build(tmp_path):
    shadow = tmp_path / "torch"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('not the installed torch')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "foundry_fp8", "doctor", "--no-te-import"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stderr  # FP8215: a shadowed torch is an error
    assert f"error FP8215 torch: Python imports torch from {shadow}, not the" in done.stdout, \
        done.stdout  # the whole folder, however long (the row cuts a long one)
    [row] = [line for line in done.stdout.splitlines() if line.startswith("torch ")]
    assert row.split(None, 1)[1] == (
        f"{metadata.version('torch')} installed, but Python imports torch from "
        f"{_short(str(shadow))} (PYTHONPATH, or the folder of the script run): that one runs"), row


def test_the_installed_packages_are_not_said_shadowed():
    assert _shadowing("torch", "torch") is None
    assert _shadowing("mosaicml", "composer") is None
    assert _shadowing("no-such-distribution", "torch") is None
    assert Path(metadata.distribution("torch").locate_file("torch")).is_dir()  # what is compared
