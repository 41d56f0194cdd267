"""The one TransformerEngine install line our fix messages give (`te.facts.TE_INSTALL_HINT`):
it must name a package pip finds. foundry-fp8 itself is not on PyPI (README "Install"), so
`pip install 'foundry-fp8[te]'` found nothing, or another's package of that name."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.rules import RULES
from foundry_fp8.lint.rules.environment import environment_findings
from foundry_fp8.te.facts import MIN_TE, TE_INSTALL_HINT

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
    [bound] = hint.specifier
    assert bound.operator == ">=" and Version(bound.version).release == MIN_TE


def test_no_fix_asks_pip_for_foundry_fp8_which_is_not_on_pypi() -> None:
    """Every rule's fix and FP8204's fixes for a run that needs TE on a machine without it."""
    findings = environment_findings(CPU, NATIVE_TE_RUN) + environment_findings(CPU, TE_RUN)
    fixes = [r.fix for r in RULES] + [f.fix for f in findings if f.fix]
    assert "FP8204" in {f.rule for f in findings}
    assert not [fix for fix in fixes if "foundry-fp8[" in fix or "foundry_fp8[" in fix]
    fp8204 = {f.fix for f in findings if f.rule == "FP8204"}
    assert fp8204 and all(TE_INSTALL_HINT in fix for fix in fp8204), fp8204
