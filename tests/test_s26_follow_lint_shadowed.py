"""FP8215: a torch, Composer or LLM-Foundry folder on PYTHONPATH (or beside the script) shadows
the installed distribution (`Snapshot.shadowed`). The environment rules judged the installed
version and the shadow's torch/version.py all the same: on a GPU node a torch source tree
without version.py made FP8212 say "torch 2.7.0 is built without CUDA (its CPU build)", an error
from no evidence, and nothing named the folder that runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import pytest

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.rules.environment import environment_findings

SHADOW = "/home/me/src/pytorch/torch"
H100 = Snapshot(python="3.11.7", torch="2.7.0+cu126", gpu_name="NVIDIA H100 80GB HBM3",
                capability=(9, 0), te="2.8.0", te_torch="2.8.0", te_core="2.8.0",
                te_core_package="transformer-engine-cu12",
                stack_ranges=(("torch", "torch<2.8,>=2.7"), ("mosaicml", "mosaicml<0.33,>=0.31"),
                              ("llm-foundry", "llm-foundry<0.23,>=0.21")),
                composer="0.32.1", llmfoundry="0.22.0")


def _rules(snapshot: Snapshot) -> dict[str, list[tuple[str, str]]]:
    found: dict[str, list[tuple[str, str]]] = {}
    for f in environment_findings(snapshot):
        found.setdefault(f.rule, []).append((f.key, f.severity))
    return found


def test_a_shadowed_torch_without_version_py_is_named_not_called_a_cpu_build():
    shadowed = replace(H100, torch_cuda=None, shadowed=(("torch", SHADOW),))
    findings = environment_findings(shadowed)
    assert "FP8212" not in {f.rule for f in findings}
    [finding] = [f for f in findings if f.rule == "FP8215"]
    assert (finding.key, finding.severity) == ("torch", "error")
    assert finding.message == (f"Python imports torch from {SHADOW}, not the installed torch "
                               "2.7.0+cu126: the torch that runs is that folder's, so its version "
                               "and CUDA build are not judged")
    assert finding.fix == (f"remove {Path(SHADOW).parent} from PYTHONPATH, or move {SHADOW} out "
                           "of the script's folder")
    # the same snapshot unshadowed is a CPU build, which FP8212 must still say
    assert _rules(replace(shadowed, shadowed=()))["FP8212"] == [("torch_cuda", "error")]


@pytest.mark.parametrize("rule, snapshot", [
    ("FP8203", replace(H100, capability=(8, 9), torch_cuda="11.8")),  # Ada, CUDA < 12.1
    ("FP8205", replace(H100, torch_cuda="13.0")),  # core package for CUDA 12, torch for 13
    ("FP8209", replace(H100, torch="2.9.0", torch_cuda="12.6")),  # no unshard_with_sync
    ("FP8212", replace(H100, torch_cuda=None)),
    ("FP8213", replace(H100, torch_cuda="13.0", driver_cuda="12.4")),
    ("FP8214", replace(H100, torch="2.9.0", torch_cuda="12.6")),
])
def test_no_rule_judges_a_shadowed_torch_s_version_or_cuda_build(rule, snapshot):
    assert rule in _rules(snapshot)  # the installed torch's facts alone make it fire
    shadowed = _rules(replace(snapshot, shadowed=(("torch", SHADOW),)))
    assert rule not in shadowed
    assert shadowed["FP8215"] == [("torch", "error")]


def test_a_shadowed_composer_or_llm_foundry_is_a_warning_and_not_judged():
    outside = replace(H100, composer="0.30.0", llmfoundry="0.20.0")
    assert [key for key, _ in _rules(outside)["FP8214"]] == ["composer", "llmfoundry"]
    shadowed = replace(outside, shadowed=(("llmfoundry", "/work/llm-foundry/llmfoundry"),))
    found = _rules(shadowed)
    assert found["FP8214"] == [("composer", "warning")]
    assert found["FP8215"] == [("llmfoundry", "warning")]
    [said] = [f.message for f in environment_findings(shadowed) if f.rule == "FP8215"]
    assert said.startswith("Python imports LLM-Foundry from /work/llm-foundry/llmfoundry, not "
                           "the installed LLM-Foundry 0.20.0: the LLM-Foundry that runs is that "
                           "folder's, so its version is not judged"), said


def test_a_run_s_fp8_lint_does_not_raise_it():
    """The doctor's: `fp8_lint` runs inside the run, which imports whatever Python finds."""
    run = {"precision": "amp_fp8", "algorithms": {"te_swap": {"backend": "te"}}}
    shadowed = replace(H100, shadowed=(("torch", SHADOW),))
    assert "FP8215" not in {f.rule for f in environment_findings(shadowed, run)}


def test_the_doctor_on_a_gpu_node_names_the_shadow_instead_of_a_cpu_build(tmp_path):
    """The real probe: nvidia-smi lists an H100 and a `torch` folder (a source tree, no
    version.py) on PYTHONPATH shadows the installed torch."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\necho "NVIDIA H100 80GB HBM3, 9.0"\n')
    smi.chmod(0o755)
    shadow = tmp_path / "src" / "torch"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('a source tree, never built')\n")
    env = {**os.environ, "PATH": f"{smi.parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(shadow.parent)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "doctor", "--no-te-import",
                           "--format", "json"], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path)
    report = json.loads(done.stdout)
    assert report["environment"]["capability"] == [9, 0]
    assert report["environment"]["shadowed"] == [["torch", str(shadow)]]
    rules = {f["rule"]: f for f in report["findings"]}
    assert "FP8212" not in rules
    assert rules["FP8215"]["severity"] == "error"
    assert rules["FP8215"]["message"].startswith(
        f"Python imports torch from {shadow}, not the installed torch {metadata.version('torch')}")
    assert report["exit_code"] == done.returncode == 1
