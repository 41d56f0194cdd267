"""QA: with an H100 listed by nvidia-smi and torch's CPU build installed, `foundry-fp8 doctor
--strict` printed its own row "CUDA none: CPU build" and then "ready for FP8 training with
TransformerEngine", exit 0. FP8212 makes that an error (the doctor's: a run reads the GPU from
torch, which then sees none: FP8201)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from foundry_fp8.environment import UNVERSIONED, Snapshot
from foundry_fp8.lint.rules.environment import environment_findings

H100_SMI = 'echo "NVIDIA H100 80GB HBM3, 9.0"'
GPU = Snapshot(python="3.11.7", torch="2.7.0+cpu", gpu_name="NVIDIA H100 80GB HBM3",
               capability=(9, 0))


def _site(tmp_path: Path, cuda: str | None) -> Path:
    """A torch on its own sys.path entry: the installed torch's own version.py, with its `cuda`
    line set as torch's build for `cuda` writes it (None: the CPU build, `+cpu` wheel); and TE
    2.8.0's three pip packages (the doctor does not import it with --no-te-import); for a torch
    for CUDA 13, TE 2.9.0's, the first with a core package for CUDA 13 (FP8205)."""
    import torch

    real = (Path(torch.__file__).parent / "version.py").read_text()
    assert re.search(r"^cuda\b.*$", real, re.MULTILINE), "torch/version.py has no cuda line"
    text = re.sub(r"^cuda\b.*$", f"cuda: Optional[str] = {cuda!r}", real, flags=re.MULTILINE)
    version = "2.7.0+cpu" if cuda is None else f"2.7.0+cu{cuda.replace('.', '')}"
    text = re.sub(r"^__version__\b.*$", f"__version__ = {version!r}", text, flags=re.MULTILINE)
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("")
    (site / "torch" / "version.py").write_text(text)
    info = site / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (site / "transformer_engine" / "pytorch").mkdir(parents=True)
    te, core = ("2.9.0", "cu13") if (cuda or "").startswith("13.") else ("2.8.0", "cu12")
    for name in ("transformer_engine", "transformer_engine_torch", f"transformer_engine_{core}"):
        info = site / f"{name}-{te}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {te}\n")
    return site


def _doctor(tmp_path: Path, cuda: str | None, *args: str) -> subprocess.CompletedProcess:
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(f"#!/bin/sh\n{H100_SMI}\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{smi.parent}:/usr/bin:/bin",
           "PYTHONPATH": str(_site(tmp_path, cuda))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "doctor", "--no-te-import",
                           *args], capture_output=True, text=True, check=False, timeout=300,
                          env=env)


def test_a_gpu_with_torch_s_cpu_build_is_an_error_not_ready(tmp_path):
    done = _doctor(tmp_path, None, "--strict")
    assert "Traceback" not in done.stderr, done.stderr
    assert "2.7.0+cpu (CUDA none: CPU build" in done.stdout  # the doctor's own row
    assert "ready for FP8 training" not in done.stdout
    assert done.returncode == 1
    assert "TransformerEngine    2.8.0 (torch extension 2.8.0, core transformer-engine-cu12 " \
        "2.8.0)" in done.stdout
    assert done.stdout.splitlines()[-1] == "foundry-fp8 doctor: exit 1 because of 1 error: FP8212"
    finding = next(line for line in done.stdout.splitlines() if "FP8212" in line)
    assert finding.startswith("error FP8212 torch_cuda: NVIDIA H100 80GB HBM3 is here, but torch "
                              "2.7.0+cpu is built without CUDA")
    assert "nvidia-smi's `CUDA Version`" in finding and "download.pytorch.org/whl/cu" in finding


def test_an_error_without_strict_too(tmp_path):
    done = _doctor(tmp_path, None, "--format", "json")
    report = json.loads(done.stdout)
    assert report["environment"]["torch_cuda"] is None
    assert report["environment"]["capability"] == [9, 0]
    assert [(f["rule"], f["severity"]) for f in report["findings"]
            if f["rule"] == "FP8212"] == [("FP8212", "error")]
    assert report["exit_code"] == done.returncode == 1


def test_torch_s_cuda_build_on_the_same_gpu_is_not_flagged(tmp_path):
    done = _doctor(tmp_path, "12.6", "--strict", "--format", "json")
    report = json.loads(done.stdout)
    assert report["environment"]["torch_cuda"] == "12.6"
    assert "FP8212" not in {f["rule"] for f in report["findings"]}
    assert report["findings"] == [] and done.returncode == 0


@pytest.mark.parametrize("snapshot", [
    replace(GPU, capability=None, gpu_name=None),  # no GPU: FP8201 says it
    replace(GPU, capability=None, gpu_hidden=True,  # CUDA_VISIBLE_DEVICES hides it: FP8201
            gpu_error="nvidia-smi lists 1 GPU(s), but CUDA_VISIBLE_DEVICES='' hides every one"),
    replace(GPU, torch=None),  # no torch at all: nothing says it is a CPU build
    replace(GPU, torch_cuda="12.6"),
    replace(GPU, torch=UNVERSIONED),  # a source tree: no version.py is no CPU build
])
def test_fp8212_only_where_a_gpu_meets_a_torch_without_cuda(snapshot):
    assert "FP8212" not in {f.rule for f in environment_findings(snapshot)}


def test_a_run_asking_for_te_gets_it_as_an_error_an_emulated_run_not():
    te_run = {"precision": "amp_fp8", "algorithms": {"te_swap": {"backend": "te"}}}
    emulated = {"precision": "amp_fp8", "algorithms": {"te_swap": {"backend": "emulate"}}}
    assert ("FP8212", "error") in {(f.rule, f.severity)
                                   for f in environment_findings(GPU, te_run)}
    assert "FP8212" not in {f.rule for f in environment_findings(GPU, emulated)}


def test_a_torch_source_tree_without_version_py_is_no_cpu_build(monkeypatch, capsys):
    """QA (session 20): a torch found without package metadata (a source tree on PYTHONPATH,
    never built, so no torch/version.py) was called "torch unknown (no package metadata) is
    built without CUDA (its CPU build)", an error and exit 1, from no evidence at all."""
    from foundry_fp8 import environment
    from foundry_fp8.cli import main

    real = environment.metadata.version

    def version(name: str) -> str:
        if name == "torch":
            raise environment.metadata.PackageNotFoundError(name)
        return real(name)

    h100 = {"gpu_name": "NVIDIA H100 80GB HBM3", "capability": (9, 0)}
    monkeypatch.setattr(environment.metadata, "version", version)
    monkeypatch.setattr(environment, "_torch_cuda", lambda: None)  # no version.py to read
    monkeypatch.setattr(environment, "_gpu_from_torch", lambda: h100)
    monkeypatch.setattr(environment, "_gpu_from_nvidia_smi", lambda _: h100)
    code = main(["doctor", "--no-te-import", "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert report["environment"]["torch"] == "unknown (no package metadata)"
    assert (report["environment"]["torch_cuda"], report["environment"]["capability"]) == \
        (None, [9, 0])
    assert "FP8212" not in {f["rule"] for f in report["findings"]}
    assert report["exit_code"] == code
