"""The one TransformerEngine install line our fix messages give (`te.facts.TE_INSTALL_HINT`):
it must name a package pip finds. foundry-fp8 itself is not on PyPI (README "Install"), so
`pip install 'foundry-fp8[te]'` found nothing, or another's package of that name."""

from __future__ import annotations

import configparser
import re
import shlex
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from foundry_fp8.environment import Snapshot, gather_snapshot
from foundry_fp8.lint.rules import RULES, all_rules
from foundry_fp8.lint.rules.environment import environment_findings
from foundry_fp8.te.facts import MIN_TE, TE_INSTALL_HINT, TE_MIN_CUDNN_FROM

REPO = Path(__file__).resolve().parents[1]
#: No TE, no GPU; a run whose model builds TE layers itself, and one te_swap gives TE.
CPU = Snapshot(python="3.11.7", torch="2.7.0")
NATIVE_TE_RUN = {"precision": "amp_fp8", "model": {"name": "mpt_causal_lm", "fc_type": "te"}}
TE_RUN = {"precision": "amp_fp8", "algorithms": {"te_swap": {"backend": "te"}}}


def _setup_cfg_te_requirement() -> Requirement:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = [Requirement(line.strip()) for line in
             config["options.extras_require"]["te"].splitlines() if line.strip()]
    [te] = [r for r in lines if r.name == "transformer-engine"]
    return te


def _pip_requirements(command: str) -> list[Requirement]:
    """The requirements a `pip install ...` command line names (its options left out)."""
    words = shlex.split(command)
    assert words[:2] == ["pip", "install"], command
    return [Requirement(w) for w in words[2:] if not w.startswith("-")]


def test_the_install_hint_is_setup_cfgs_te_extra_and_min_te() -> None:
    [hint] = _pip_requirements(TE_INSTALL_HINT)
    te = _setup_cfg_te_requirement()
    assert (hint.name, hint.extras, str(hint.specifier)) == (te.name, te.extras, str(te.specifier))
    assert hint.extras == {"pytorch"}  # without it pip installs TE's empty metapackage
    bounds = {b.operator: Version(b.version).release for b in hint.specifier}
    assert bounds == {">=": MIN_TE, "<": TE_MIN_CUDNN_FROM}  # TE 2.20 refuses torch 2.7's cuDNN


def test_no_fix_asks_pip_for_foundry_fp8_which_is_not_on_pypi() -> None:
    """Every rule's fix and FP8204's fixes for a run that needs TE on a machine without it."""
    findings = environment_findings(CPU, NATIVE_TE_RUN) + environment_findings(CPU, TE_RUN)
    fixes = [r.fix for r in RULES] + [f.fix for f in findings if f.fix]
    assert "FP8204" in {f.rule for f in findings}
    assert not [fix for fix in fixes if "foundry-fp8[" in fix or "foundry_fp8[" in fix]
    fp8204 = {f.fix for f in findings if f.rule == "FP8204"}
    assert fp8204 and all(TE_INSTALL_HINT in fix for fix in fp8204), fp8204


def _te_metadata(site: Path, names: tuple[str, ...], version: str) -> None:
    """pip's records of TE packages: a dist-info each, as an interrupted uninstall leaves them."""
    for name in names:
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


@pytest.mark.parametrize("files", ["none", "no-library"])
def test_fp8206_with_te_files_gone_says_reinstall_not_rebuild(tmp_path, monkeypatch, files):
    """QA (session 19): pip still lists TE but its files are gone; the doctor's FP8206 said
    "rebuild TE against the installed torch", which needs the files. The error is the real
    probe's (a fresh Python importing TE); the fix must uninstall what pip lists and install
    that version again, both read from the dist-infos, not from our snapshot."""
    names = ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu12")
    _te_metadata(tmp_path, names, "2.8.0")
    if files == "no-library":  # TE's own words when its compiled library is missing
        (tmp_path / "transformer_engine" / "pytorch").mkdir(parents=True)
        (tmp_path / "transformer_engine" / "__init__.py").write_text("")
        (tmp_path / "transformer_engine" / "pytorch" / "__init__.py").write_text(
            "raise FileNotFoundError('Could not find shared object file for Transformer Engine "
            "torch lib.')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    snapshot = gather_snapshot(probe_te_import=True, probe_gpu=False)
    assert snapshot.te_import_error and "transformer" in snapshot.te_import_error.lower()
    [finding] = [f for f in environment_findings(snapshot) if f.rule == "FP8206"]
    assert "rebuild" not in finding.fix and finding.fix.startswith("reinstall")
    uninstall, install = finding.fix.split(": ", 1)[1].split(", then ")
    listed = {d.metadata["Name"]: d.version for d in metadata.distributions(path=[str(tmp_path)])}
    assert shlex.split(uninstall)[:3] == ["pip", "uninstall", "-y"]
    assert sorted(shlex.split(uninstall)[3:]) == sorted(listed)
    [te] = _pip_requirements(install)
    assert te.name == "transformer-engine" and te.extras == {"pytorch"}
    assert te.specifier.contains(listed["transformer-engine"]) and str(te.specifier) == "==2.8.0"


def test_fp8206_for_a_te_that_does_not_load_keeps_the_rebuild_fix():
    snapshot = Snapshot(python="3", capability=(9, 0), te="2.8.0", te_import_checked=True,
                        te_import_error="ImportError: transformer_engine_torch.so: undefined "
                        "symbol: _ZN3c10")
    [finding] = [f for f in environment_findings(snapshot) if f.rule == "FP8206"]
    assert finding.fix.startswith("rebuild TransformerEngine from its source against the "
                                  "installed torch")  # no transformer-engine-torch package


def test_no_fix_sends_a_wheel_user_to_a_file_the_wheel_lacks():
    """QA (session 19): FP8030's fix ended "(docs/te_swap.md)"; a wheel installs the package
    alone (setup.cfg `packages = find_namespace:`), so no docs/ folder is on the user's disk."""
    for rule in all_rules():
        for path in re.findall(r"[\w./-]+\.md\b", rule.fix):
            assert (REPO / "foundry_fp8").joinpath(path).is_file(), (rule.id, path)
