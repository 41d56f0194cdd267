"""QA: with an H100 whose driver supports CUDA 12.4 (nvidia-smi's header) and torch built for
CUDA 13.0, `foundry-fp8 doctor --strict` said "ready for FP8 training", exit 0; torch then fails
at its first CUDA call ("The NVIDIA driver on your system is too old"). The doctor did not read
the driver's CUDA at all (`--query-gpu` has no field for it). FP8213 compares them: a newer
major is an error, a newer minor only an info (CUDA minor version compatibility)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foundry_fp8 import environment
from foundry_fp8.environment import gather_snapshot
from tests.test_doctor_torch_cuda import _site

#: Plain `nvidia-smi`'s first lines as drivers print them: 550.40.07 (Frogging-Family/nvidia-all
#: PR #212) and, from driver 610, the renamed labels (sgl-project/sglang issue #27487).
HEADER_550 = """\
Wed Jan 24 15:18:40 2024
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.40.07              Driver Version: 550.40.07      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |
|                                         |                        |               MIG M. |
|=========================================+========================+======================|
|   0  NVIDIA H100 80GB HBM3          On  |   00000000:18:00.0 Off |                    0 |
| N/A   27C    P0             69W /  700W |       0MiB /  81559MiB |      0%      Default |
|                                         |                        |             Disabled |
+-----------------------------------------+------------------------+----------------------+
"""
HEADER_610 = HEADER_550.replace(
    "| NVIDIA-SMI 550.40.07              Driver Version: 550.40.07      CUDA Version: 12.4     |",
    "| NVIDIA-SMI 610.43.02              KMD Version: 610.43.02     CUDA UMD Version: 13.3     |")


def _smi(folder: Path, table: str, plain: str | None = None) -> None:
    """A fake nvidia-smi: the GPU query's CSV row, and `table` (or the shell `plain`) when run
    without arguments, as the real one prints its table."""
    folder.mkdir(exist_ok=True)
    (folder / "table.txt").write_text(table)
    plain = plain or f'cat "{folder / "table.txt"}"'
    smi = folder / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\nif [ "$#" -eq 0 ]; then {plain}; exit 0; fi\n'
                   'echo "NVIDIA H100 80GB HBM3, 9.0"\n')
    smi.chmod(0o755)


def _doctor(tmp_path: Path, cuda: str, table: str, *args: str) -> subprocess.CompletedProcess:
    _smi(tmp_path / "bin", table)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
           "PYTHONPATH": str(_site(tmp_path, cuda))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "doctor", "--no-te-import",
                           *args], capture_output=True, text=True, check=False, timeout=300,
                          env=env)


def _snapshot(tmp_path, monkeypatch, table: str, plain: str | None = None):
    _smi(tmp_path / "bin", table, plain)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # else the GPU comes from torch
    return gather_snapshot(probe_te_import=False)


@pytest.mark.parametrize(("table", "expected"), [
    (HEADER_550, "12.4"), (HEADER_610, "13.3"),
    (HEADER_550.replace("CUDA Version: 12.4", "CUDA Version: N/A "), None),
    ("NVIDIA H100 80GB HBM3, 9.0\n", None),  # an nvidia-smi printing no header
])
def test_the_driver_s_cuda_is_read_from_nvidia_smi_s_header(tmp_path, monkeypatch, table,
                                                            expected):
    snapshot = _snapshot(tmp_path, monkeypatch, table)
    assert (snapshot.gpu_name, snapshot.capability) == ("NVIDIA H100 80GB HBM3", (9, 0))
    assert snapshot.driver_cuda == expected and snapshot.gpu_error is None


def test_a_hanging_header_call_leaves_the_gpu_read(tmp_path, monkeypatch):
    monkeypatch.setattr(environment, "NVIDIA_SMI_TIMEOUT_S", 1)
    snapshot = _snapshot(tmp_path, monkeypatch, HEADER_550, plain="sleep 30")
    assert (snapshot.gpu_name, snapshot.capability, snapshot.gpu_error) == \
        ("NVIDIA H100 80GB HBM3", (9, 0), None)
    assert snapshot.driver_cuda is None


def test_torch_for_a_newer_cuda_major_than_the_driver_is_an_error(tmp_path):
    done = _doctor(tmp_path, "13.0", HEADER_550, "--strict")
    assert "Traceback" not in done.stderr, done.stderr
    assert "ready for FP8 training" not in done.stdout
    assert done.returncode == 1
    assert "; its driver supports CUDA 12.4 at most" in done.stdout  # the GPU row
    assert done.stdout.splitlines()[-1] == "foundry-fp8 doctor: exit 1 because of 1 error: FP8213"
    finding = next(line for line in done.stdout.splitlines() if "FP8213" in line)
    assert finding.startswith("error FP8213 torch_cuda: torch 2.7.0+cu130 is built for CUDA "
                              "13.0, but the NVIDIA driver supports CUDA 12.4 at most")
    assert "(fix: install a torch build for CUDA the driver supports" in finding


@pytest.mark.parametrize(("cuda", "table", "severity"), [
    ("12.6", HEADER_550, "info"),  # a newer minor: minor version compatibility
    ("12.4", HEADER_550, None),
    ("12.1", HEADER_550, None),
    ("13.0", HEADER_610, None),
    ("12.8", HEADER_610, None),  # an older major: the driver runs it
])
def test_a_newer_minor_is_an_info_an_equal_or_older_cuda_nothing(tmp_path, cuda, table,
                                                                   severity):
    done = _doctor(tmp_path, cuda, table, "--strict", "--format", "json")
    report = json.loads(done.stdout)
    assert report["environment"]["driver_cuda"] == ("12.4" if table == HEADER_550 else "13.3")
    assert report["environment"]["torch_cuda"] == cuda
    assert [f["severity"] for f in report["findings"] if f["rule"] == "FP8213"] == \
        ([severity] if severity else [])
    assert report["exit_code"] == done.returncode == 0
    assert set(report) == {"schema", "environment", "findings", "exit_code", "exit_reason"}
