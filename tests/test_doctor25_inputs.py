"""QA session 25, outside-in on `foundry-fp8 doctor`: (1) a torch/version.py that is not UTF-8
(a damaged install) ended the doctor in a UnicodeDecodeError traceback; (2) with `--no-te-import`
the doctor ended "ready for FP8 training with TransformerEngine" on package metadata alone, for
a TE whose import fails (TE 2.20.2 installed as `transformer-engine[core]`: no torch extension,
so `import transformer_engine.pytorch` raises FileNotFoundError "Could not find shared object
file for Transformer Engine torch lib", transformer_engine/common/__init__.py:154-156)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from foundry_fp8 import doctor
from foundry_fp8.cli import main
from foundry_fp8.environment import Snapshot

H100 = Snapshot(python="3.11.7", torch="2.7.0", torch_cuda="12.6", gpu_name="NVIDIA H100",
                capability=(9, 0), te="2.20.2", te_torch="2.20.2", te_core="2.20.2",
                te_core_package="transformer-engine-cu12", te_import_checked=True)


def test_a_torch_version_file_that_is_not_utf8_is_no_traceback(tmp_path: Path):
    """The real doctor on a sys.path whose torch/version.py is not UTF-8 (Python itself would
    refuse to import it): its CUDA is unknown, and the doctor reports instead of crashing."""
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("")
    (site / "torch" / "version.py").write_bytes(b"\xff\xfe__version__ = '2.7.0'\ncuda = '12.6'\n")
    info = site / "torch-2.7.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.7.0\n")
    env = {**os.environ, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)}  # no nvidia-smi
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "doctor", "--no-te-import"],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    assert done.returncode == 0, done.stderr  # no GPU: a warning, nothing broken
    torch_row = next(line for line in done.stdout.splitlines() if line.startswith("torch "))
    assert "2.7.0" in torch_row


@pytest.mark.parametrize(("checked", "ready"), [
    (True, doctor.READY),
    (False, doctor.READY + doctor.UNTRIED),
])
def test_ready_says_whether_te_s_import_was_tried(capsys, monkeypatch, checked, ready):
    monkeypatch.setattr(doctor, "gather_snapshot",
                        lambda **_: replace(H100, te_import_checked=checked))
    assert main(["doctor", "--strict"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == ready
    assert ("--no-te-import" in last) is not checked


def test_without_te_ready_needs_no_import(capsys, monkeypatch):
    """No TE to import (a no-GPU machine is never ready; here a run on the emulated backend has
    nothing to try): the plain line, whatever the flag."""
    monkeypatch.setattr(doctor, "environment_findings", lambda snapshot: [])
    monkeypatch.setattr(doctor, "gather_snapshot",
                        lambda **_: replace(H100, te=None, te_torch=None, te_core=None,
                                            te_core_package=None, te_import_checked=False))
    assert main(["doctor", "--no-te-import"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == doctor.READY
