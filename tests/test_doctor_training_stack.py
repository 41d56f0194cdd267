"""FP8214: `foundry-fp8 doctor` where torch, Composer or LLM-Foundry is missing (`pip install
--no-deps`) or outside setup.cfg's ranges. It exited 0 showing only FP8201 ("no GPU"), so a
machine that can run nothing of foundry-fp8 passed. The references: setup.cfg itself (read with
configparser) and `packaging`'s PEP 440 specifier sets, never our parser."""

from __future__ import annotations

import configparser
import json
from dataclasses import replace
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from foundry_fp8 import doctor, environment
from foundry_fp8.cli import main
from foundry_fp8.environment import STACK, Snapshot, gather_snapshot
from foundry_fp8.lint.rules.environment import environment_findings

ROOT = Path(__file__).resolve().parent.parent


def _setup_cfg_stack() -> dict[str, Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in cfg["options"]["install_requires"].splitlines()]
    found = {}
    for line in lines:
        if line and not line.startswith("#"):
            requirement = Requirement(line)
            if requirement.name in STACK:
                found[requirement.name] = requirement
    return found


SETUP_CFG = _setup_cfg_stack()
#: A snapshot whose ranges are setup.cfg's, as an installed wheel's metadata carries them.
RANGES = tuple((name, str(r)) for name, r in SETUP_CFG.items())
#: This machine's set, in range (constraints/ci.txt), without GPU findings' noise.
IN_RANGE = Snapshot(python="3.11.7", torch="2.7.0+cu126", composer="0.32.1",
                    llmfoundry="0.22.0", capability=(9, 0), torch_cuda="12.6", te="2.8.0",
                    stack_ranges=RANGES)


def _stack(snapshot: Snapshot) -> list[tuple[str, str, str]]:
    return [(f.key, f.severity, f.fix) for f in environment_findings(snapshot)
            if f.rule == "FP8214"]


def test_setup_cfg_names_the_whole_stack():
    assert set(SETUP_CFG) == set(STACK) == {"torch", "mosaicml", "llm-foundry"}


def test_the_installed_ranges_are_setup_cfgs():
    """What the doctor reads (the installed foundry-fp8's Requires-Dist) is setup.cfg's."""
    read = dict(gather_snapshot(probe_te_import=False, probe_gpu=False).stack_ranges)
    assert {name: Requirement(text) for name, text in read.items()} == SETUP_CFG


@pytest.mark.parametrize("name", ["mosaicml", "llm-foundry"])
def test_the_finding_names_a_package_as_the_doctor_s_table_does(name, capsys):
    """QA (session 20): the table's row said "LLM-Foundry" and FP8214 "LLM-Foundry
    (llm-foundry) is not installed", two names for one package, kept in two places."""
    field = STACK[name].field
    missing = replace(IN_RANGE, **{field: None})
    [finding] = [f for f in environment_findings(missing) if f.rule == "FP8214"]
    [(row, shown)] = set(doctor._rows(missing)) - set(doctor._rows(IN_RANGE))
    assert shown == "not installed"
    assert finding.message.startswith(f"{row} is not installed: foundry-fp8 needs {name}")


def test_in_range_says_nothing():
    assert _stack(IN_RANGE) == []


@pytest.mark.parametrize("field", sorted(p.field for p in STACK.values()))
def test_missing_is_an_error_naming_setup_cfgs_range(field):
    [(key, severity, fix)] = _stack(replace(IN_RANGE, **{field: None}))
    [name] = [n for n, p in STACK.items() if p.field == field]
    assert (key, severity) == (field, "error")
    installed = Requirement(fix.removeprefix("pip install ").strip("'"))
    assert installed == SETUP_CFG[name]


#: Each side of each bound, a bound written short, local and pre-release versions.
VERSIONS = {
    "torch": ["2.6.0", "2.7", "2.7.0", "2.7.1+cu126", "2.7.9", "2.8", "2.8.0a0+git1234", "2.8.0",
              "3.0.0"],
    "mosaicml": ["0.30.0", "0.31", "0.31.0", "0.32.1", "0.33.0.dev0", "0.33.0", "1.0.0"],
    "llm-foundry": ["0.20.1", "0.21.0", "0.22.0", "0.22.9", "0.23.0rc1", "0.23.0"],
}


@pytest.mark.parametrize(("name", "version"),
                         [(n, v) for n, versions in VERSIONS.items() for v in versions])
def test_outside_the_range_is_a_warning_where_packaging_says_so(name, version):
    """FP8214 warns exactly where packaging's PEP 440 evaluation of setup.cfg's specifier
    rejects the version (pre-releases admitted, as `pip install --pre` would: `2.8.0a0` of
    `<2.8` is still out)."""
    snapshot = replace(IN_RANGE, **{STACK[name].field: version})
    spec: SpecifierSet = SETUP_CFG[name].specifier
    expected = [] if spec.contains(version, prereleases=True) else [(STACK[name].field, "warning")]
    assert [(k, s) for k, s, _ in _stack(snapshot)] == expected


def test_runs_and_unknown_ranges_are_not_judged():
    """fp8_lint runs inside the stack; without foundry-fp8's metadata there are no ranges."""
    bare = replace(IN_RANGE, torch=None, composer=None, llmfoundry=None)
    assert [f for f in environment_findings(bare, {"precision": "amp_bf16"})
            if f.rule == "FP8214"] == []
    assert _stack(replace(bare, stack_ranges=())) == []


def test_doctor_without_the_stack_exits_1_and_says_why(monkeypatch, capsys):
    """The QA's machine: the wheel installed with --no-deps (its metadata carries the ranges),
    nothing of the stack. gather_snapshot runs for real; only the three look-ups are hidden."""
    real, find = environment._version, environment.util.find_spec
    monkeypatch.setattr(environment, "_version",
                        lambda name: None if name in STACK else real(name))
    monkeypatch.setattr(environment.util, "find_spec",
                        lambda name, *a: None if name in {p.field for p in STACK.values()}
                        else find(name, *a))
    assert main(["doctor", "--no-te-import"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("foundry-fp8 doctor: exit 1 because of 3 errors: FP8214")
    rows = [line for line in out if line.startswith("error FP8214")]
    assert len(rows) == 3 and any("'torch>=2.7.0,<2.8'" in row for row in rows)
    monkeypatch.setattr(doctor, "gather_snapshot", lambda **_: replace(IN_RANGE,
                                                                         llmfoundry="0.20.0"))
    assert main(["doctor", "--format", "json"]) == 0  # a warning: --strict fails it
    report = json.loads(capsys.readouterr().out)
    assert [f["rule"] for f in report["findings"]] == ["FP8214"]
    assert report["environment"]["stack_ranges"] == [list(r) for r in RANGES]
    assert main(["doctor", "--strict"]) == 1


def test_importable_without_metadata_is_a_warning_not_missing(monkeypatch, capsys):
    """Composer importable (here it is: find_spec is Python's own answer, and the doctor's
    table and JSON show what it found) but without package metadata (a source tree on
    PYTHONPATH, a vendored copy): its version is unknown, not absent. It was an FP8214 error
    'Composer (mosaicml) is not installed' and exit 1. Nothing of the stack is imported."""
    import importlib.util
    import subprocess
    import sys

    real = environment.metadata.version

    def version(name: str) -> str:
        if name == "mosaicml":
            raise environment.metadata.PackageNotFoundError(name)
        return real(name)

    assert importlib.util.find_spec("composer") is not None
    monkeypatch.setattr(environment.metadata, "version", version)
    assert main(["doctor", "--no-te-import", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["environment"]["composer"] == environment.UNVERSIONED  # as for TE (FP8210)
    [finding] = [f for f in report["findings"] if f["rule"] == "FP8214"]
    assert (finding["key"], finding["severity"]) == ("composer", "warning")
    assert "importable but without package metadata" in finding["message"]
    assert "not installed" not in finding["message"]
    assert main(["doctor", "--no-te-import"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert "Composer (mosaicml)  unknown (no package metadata)" in rows
    # torch-free as before: the probe finds packages, it never imports them
    probe = ("import sys; from importlib import metadata; real = metadata.version\n"
             "def version(name):\n"
             "    if name in ('torch', 'mosaicml', 'llm-foundry'):\n"
             "        raise metadata.PackageNotFoundError(name)\n"
             "    return real(name)\n"
             "metadata.version = version\n"
             "from foundry_fp8.environment import gather_snapshot\n"
             "s = gather_snapshot(probe_te_import=False, probe_gpu=False)\n"
             "print({s.torch, s.composer, s.llmfoundry}, [m for m in ('torch', 'composer',"
             " 'llmfoundry') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.stdout.strip() == f"{{{environment.UNVERSIONED!r}}} []", done.stderr


def test_an_unreadable_version_is_a_warning():
    [(key, severity, _)] = _stack(replace(IN_RANGE, llmfoundry="main"))
    assert (key, severity) == ("llmfoundry", "warning")


def test_ngc_pre_release_counts_as_its_release():
    """NGC's torch names its 2.7.0 build 2.7.0a0+<sha>.nv25.04: FP8214 takes it as 2.7.0, inside
    `>=2.7.0`, where PEP 440 (packaging) puts it before 2.7.0, outside. On purpose: a warning
    on every NGC 25.04 image would be noise. Above the upper bound it is still out."""
    ngc = "2.7.0a0+79aa17489c.nv25.04"
    assert not SETUP_CFG["torch"].specifier.contains(ngc, prereleases=True)
    assert SETUP_CFG["torch"].specifier.contains("2.7.0", prereleases=True)
    assert _stack(replace(IN_RANGE, torch=ngc)) == []
    assert [(k, s) for k, s, _ in _stack(replace(IN_RANGE, torch="2.8.0a0+git1.nv25.06"))] == [
        ("torch", "warning")]


@pytest.mark.parametrize("text", [
    "mosaicml[wandb]<0.33,>=0.31.0", "torch (>=2.7.0,<2.8)", "llm-foundry>=0.21.0,<0.23",
    "Transformer_Engine[PyTorch, jax]==2.8.0", "torch", "flash-attn==2.7.*",
    "mlflow>=2.0; extra == \"mlflow\"", "torch~=2.7.0 ; python_version >= \"3.10\"",
])
def test_requirements_read_as_packaging_reads_them(text):
    """The one reader of requirement strings (packages.parse_requirement), shared by the
    doctor's ranges and the MCLI pins, against packaging's PEP 508 parser."""
    from packaging.utils import canonicalize_name

    from foundry_fp8.packages import normalized, parse_requirement

    ours, theirs = parse_requirement(text), Requirement(text)
    assert ours is not None
    assert ours.distribution == normalized(theirs.name) == canonicalize_name(theirs.name)
    assert set(ours.extras) == {canonicalize_name(e) for e in theirs.extras}
    assert sorted(ours.clauses) == sorted((s.operator, s.version) for s in theirs.specifier)
    assert (ours.marker is None) == (theirs.marker is None)


@pytest.mark.parametrize("text", ["foo @ https://example.com/foo.whl", "torch>=abc", "-e",
                                  "git+https://github.com/mosaicml/composer.git@v0.32.1"])
def test_requirements_without_a_readable_version_are_none(text):
    from foundry_fp8.packages import parse_requirement

    assert parse_requirement(text) is None
