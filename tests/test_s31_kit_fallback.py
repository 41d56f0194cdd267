"""`benchmarks/gpu/install.sh`'s fallback for TE 2.20.2's pure-Python imports from the device
(onnxscript and onnx_ir: pytorch/onnx_extensions.py:26-28; einops: attention/inference.py:9):
a `NAME.whl.fallback` in the parts is installed only where the device has no NAME, so the
device's own version stays the one used elsewhere. Before, the kit carried none: a device
image without onnxscript failed install.sh's import check (seen on a CPU rehearsal with the
real TE 2.20.2: `ModuleNotFoundError: No module named 'onnxscript'`), costing the lease.

Stand-ins: `python3` runs the real interpreter for the presence check (importlib's find_spec,
without site-packages, on a PYTHONPATH where the test puts the "device's" packages) and records
every pip install; join-and-install.sh only makes the target folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
WHEELS = ("einops-0.8.2-py3-none-any.whl", "onnx_ir-1.0.0-py3-none-any.whl",
          "onnxscript-0.7.2-py3-none-any.whl")

PYTHON3 = f"""#!/bin/bash
case "$*" in
  *find_spec*) exec {sys.executable} -S "$@" ;;  # no site-packages: the device is PYTHONPATH
  *"-m pip install"*) for a in "$@"; do case "$a" in *.whl) basename "$a" >> "$PIP_LOG" ;; esac; done ;;
  *) echo "versions line" ;;
esac
"""


def _kit(tmp_path: Path) -> Path:
    """A checkout holding install.sh and one part folder with the three fallbacks."""
    repo = tmp_path / "repo"
    (repo / "benchmarks/gpu").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "benchmarks/gpu/install.sh", repo / "benchmarks/gpu/install.sh")
    part = repo / "gpu-parts/p6"
    part.mkdir(parents=True)
    (part / "join-and-install.sh").write_text('mkdir -p "$2"\n')
    for wheel in WHEELS:
        (part / f"{wheel}.fallback").write_bytes(b"PK")
    return repo


@pytest.mark.parametrize("device_has", [(), ("onnxscript", "einops"),
                                        ("onnxscript", "onnx_ir", "einops")])
def test_a_fallback_is_installed_only_where_the_device_lacks_the_package(tmp_path, device_has):
    repo, stubs, device = _kit(tmp_path), tmp_path / "bin", tmp_path / "device"
    stubs.mkdir()
    (stubs / "python3").write_text(PYTHON3)
    (stubs / "python3").chmod(0o755)
    for module in device_has:  # the device's own packages
        (device / module).mkdir(parents=True)
        (device / module / "__init__.py").write_text("")
    log = tmp_path / "pip.log"
    log.write_text("")
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "PYTHONPATH": str(device),
           "PIP_LOG": str(log)}
    done = subprocess.run(["bash", str(repo / "benchmarks/gpu/install.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    installed = [line for line in log.read_text().splitlines() if line in WHEELS]
    wanted = [w for w in WHEELS if w.split("-")[0] not in device_has]
    assert installed == wanted, done.stdout + done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith("kit fallback")]
    assert said == [f"kit fallback installed: {w} (the device has no {w.split('-')[0]})"
                    for w in wanted]
    assert (repo / ".gpu-site/.kit-installed").exists()
