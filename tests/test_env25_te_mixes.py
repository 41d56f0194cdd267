"""QA session 25, TE package mixes the doctor called ready or misadvised (FP8204-FP8206), judged
against TE 2.20.2's sources: (a) `transformer-engine[core]` without `[pytorch]`: `import
transformer_engine.pytorch` raises FileNotFoundError "Could not find shared object file for
Transformer Engine torch lib." (transformer_engine/common/__init__.py:154-156), and `import
llmfoundry` with it; (b) a core package for another CUDA major than torch's (the torch extension
requires transformer_engine_cu{torch's major}, pytorch/setup.py:170-173; the cu13 core library
needs libcudart.so.13/libcublas.so.13); (c) metapackage 2.8 with core 2.9, whose Python files
compare the two (sanity_checks_for_pypi_installation, common/__init__.py:249-265); (d) FP8206's
fix by the import error: "Transformer Engine requires cuDNN 9.12.0 or later, but the cuDNN
runtime is 9.5.1." (common/__init__.py:35-42, torch 2.7 pins nvidia-cudnn-cu12 9.5.1.17), the
loader's "cannot open shared object file", the torch extension's library not found."""

from __future__ import annotations

import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from foundry_fp8.doctor import exit_code
from foundry_fp8.environment import Snapshot, gather_snapshot
from foundry_fp8.lint.rules.environment import environment_findings

#: TE 2.20.2 pip-installed whole on an H100 with torch 2.7 for CUDA 12.6; TE's import not tried.
H100 = Snapshot(python="3.11.7", torch="2.7.0", torch_cuda="12.6", gpu_name="NVIDIA H100",
                capability=(9, 0), te="2.20.2", te_torch="2.20.2", te_core="2.20.2",
                te_core_package="transformer-engine-cu12", te_pure_wheel=True)
#: `pip install "transformer-engine[core]==2.20.2"`: metapackage and core, no torch extension.
CORE_ONLY = replace(H100, te_torch=None)


def _requirements(fix: str) -> list[Requirement]:
    """The pip requirements a fix names, each quoted as a shell word."""
    return [Requirement(r) for r in re.findall(r"'([^']+)'", fix)]


def _by_rule(snapshot: Snapshot) -> dict[str, list]:
    found: dict[str, list] = {}
    for finding in environment_findings(snapshot):
        found.setdefault(finding.rule, []).append(finding)
    return found


def test_te_core_without_its_torch_extension_is_an_error():
    """(a) With torch installed no run starts: an error, fixed by installing `[pytorch]` at the
    installed version (which pulls the core package for torch's CUDA)."""
    [finding] = environment_findings(CORE_ONLY)
    assert (finding.rule, finding.severity) == ("FP8204", "error")
    assert "no torch extension" in finding.message and "llmfoundry" in finding.message
    [te] = _requirements(finding.fix)
    assert (te.name, te.extras, str(te.specifier)) == ("transformer-engine", {"pytorch"},
                                                       "==2.20.2")
    assert exit_code([finding], strict=False) == 1


@pytest.mark.parametrize(("torch", "severity"), [("2.7.0", "error"), (None, "warning")])
def test_te_metapackage_alone_is_an_error_where_torch_is_installed(torch, severity):
    alone = replace(CORE_ONLY, te_core=None, te_core_package=None, torch=torch)
    assert [(f.rule, f.severity) for f in environment_findings(alone)
            if f.rule == "FP8204"] == [("FP8204", severity)]


def test_te_core_only_is_found_from_package_metadata(tmp_path: Path, monkeypatch):
    """(a) at the real reader: dist-infos as pip writes them for `transformer-engine[core]`
    (the metapackage a pure wheel, TE's own test for it), read by the doctor's gathering."""
    for name, purelib in (("transformer-engine", True), ("transformer-engine-cu12", False)):
        info = tmp_path / f"{name.replace('-', '_')}-2.20.2.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 2.20.2\n")
        (info / "WHEEL").write_text(f"Wheel-Version: 1.0\nRoot-Is-Purelib: {str(purelib).lower()}"
                                    "\nTag: x\n")
        (info / "RECORD").write_text(f"{info.name}/WHEEL,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    snapshot = gather_snapshot(probe_te_import=False, probe_gpu=False)
    assert (snapshot.te, snapshot.te_core, snapshot.te_torch, snapshot.te_pure_wheel) == \
        ("2.20.2", "2.20.2", None, True)
    if snapshot.torch is None:
        pytest.skip("torch is not installed here")
    assert ("FP8204", "error") in [(f.rule, f.severity) for f in environment_findings(snapshot)]


@pytest.mark.parametrize(("te", "core", "torch_cuda", "uninstall", "install"), [
    ("2.20.2", "transformer-engine-cu13", "12.6", "transformer-engine-cu13",
     "transformer-engine-cu12"),
    ("2.20.2", "transformer-engine-cu12", "13.0", "transformer-engine-cu12",
     "transformer-engine-cu13"),
])
def test_a_core_package_for_another_cuda_than_torch_s_is_an_error(te, core, torch_cuda,
                                                                   uninstall, install):
    """(b) Uninstall the wrong core first, then reinstall the right one: both write the same
    files, so uninstalling one deletes what the other installed."""
    snapshot = replace(H100, te=te, te_torch=te, te_core=te, te_core_package=core,
                       torch_cuda=torch_cuda)
    [finding] = environment_findings(snapshot)
    assert (finding.rule, finding.severity) == ("FP8205", "error")
    assert f"CUDA {torch_cuda}" in finding.message
    removal, reinstall = finding.fix.split(", then ")
    assert shlex.split(removal) == ["pip", "uninstall", "-y", uninstall]
    [wanted] = _requirements(reinstall)
    assert (wanted.name, str(wanted.specifier)) == (install, f"=={te}")
    assert shlex.split(reinstall).index(f"{install}=={te}") > reinstall.split().index("install")


def test_a_te_without_a_cuda_13_core_on_torch_for_cuda_13_says_so():
    """(b) Before TE 2.9 no cu13 core package exists (TE v2.8 setup.py:142 pins cu12)."""
    snapshot = replace(H100, te="2.8.0", te_torch="2.8.0", te_core="2.8.0", torch_cuda="13.0")
    [finding] = environment_findings(snapshot)
    assert finding.rule == "FP8205" and "uninstall" not in finding.fix
    assert "torch build for CUDA 12" in finding.fix and "2.9" in finding.fix


def test_a_core_for_another_cuda_that_imports_is_a_warning():
    snapshot = replace(H100, te_core_package="transformer-engine-cu13", te_import_checked=True)
    [finding] = environment_findings(snapshot)
    assert (finding.rule, finding.severity) == ("FP8205", "warning")


def test_matching_core_packages_are_quiet():
    assert environment_findings(H100) == []
    assert environment_findings(replace(H100, torch_cuda="13.0",
                                        te_core_package="transformer-engine-cu13")) == []


def test_a_core_newer_than_the_metapackage_is_checked():
    """(c) QA mix 16: metapackage 2.8.0 with core 2.9.0 was ready; 2.9's Python files (the
    core's, when installed last) compare the two at `import transformer_engine`."""
    mix = replace(H100, te="2.8.0", te_torch=None, te_core="2.9.0", te_pure_wheel=False)
    assert [(f.rule, f.severity) for f in environment_findings(mix)] == [("FP8205", "error")]


CUDNN = "RuntimeError: Transformer Engine requires cuDNN 9.12.0 or later, but the cuDNN " \
    "runtime is 9.5.1."


def test_te_s_cudnn_refusal_names_cudnn_not_a_rebuild():
    """(d) TE 2.20.2 with torch 2.7's cuDNN 9.5.1: rebuilding TE's extension changes nothing."""
    snapshot = replace(H100, te_import_checked=True, te_import_error=CUDNN,
                       te_import_raised="RuntimeError")
    [finding] = environment_findings(snapshot)
    assert finding.rule == "FP8206" and "rebuild" not in finding.fix
    cudnn, te = _requirements(finding.fix)
    assert cudnn.name == "nvidia-cudnn-cu12" and cudnn.specifier.contains("9.12.0") \
        and not cudnn.specifier.contains("9.5.1.17")
    assert te.name == "transformer-engine" and te.specifier.contains("2.19.0") \
        and not te.specifier.contains("2.20.2")


def test_a_missing_cuda_library_of_a_core_for_another_cuda_names_the_swap():
    snapshot = replace(H100, te_core_package="transformer-engine-cu13", te_import_checked=True,
                       te_import_raised="OSError", te_import_error="OSError: libcublas.so.13: "
                       "cannot open shared object file: No such file or directory")
    fixes = {f.rule: f.fix for f in environment_findings(snapshot)}
    assert fixes["FP8206"] == fixes["FP8205"] and "transformer-engine-cu12==2.20.2" in \
        fixes["FP8206"]


NO_TORCH_LIB = "FileNotFoundError: Could not find shared object file for Transformer Engine " \
    "torch lib."


@pytest.mark.parametrize(("snapshot", "fix_starts"), [
    (CORE_ONLY, "pip install --no-build-isolation 'transformer-engine[pytorch]==2.20.2'"),
    (H100, "reinstall TransformerEngine"),  # the extension is installed: its files are gone
])
def test_the_torch_extension_s_library_not_found(snapshot, fix_starts):
    snapshot = replace(snapshot, te_import_checked=True, te_import_error=NO_TORCH_LIB,
                       te_import_raised="FileNotFoundError")
    [finding] = _by_rule(snapshot)["FP8206"]
    assert finding.fix.startswith(fix_starts)
