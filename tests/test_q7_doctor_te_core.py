"""FP8205 on TE's torch extension installed without its core package (transformer-engine-cu12/
cu13): TE's `load_framework_extension` asserts "Could not find TE core package" (v2.9-v2.18
transformer_engine/common/__init__.py:176-178; "Could not find `transformer-engine-cu12`" from
v1.12), so the doctor must say so from package metadata alone, `--no-te-import` included."""

from __future__ import annotations

import shlex
from dataclasses import replace

import pytest
from packaging.requirements import Requirement

from foundry_fp8.doctor import exit_code
from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.rules.environment import environment_findings

#: A pip-installed TE whose core package is gone; the TE import not tried (`--no-te-import`).
NO_CORE = Snapshot(python="3.11.7", torch="2.7.0", torch_cuda="12.6", gpu_name="NVIDIA H100",
                   capability=(9, 0), te="2.18.0", te_torch="2.18.0", te_pure_wheel=True)


@pytest.mark.parametrize(("te", "torch_cuda", "core"), [
    ("2.18.0", "12.6", "transformer-engine-cu12"),
    ("2.18.0", "13.0", "transformer-engine-cu13"),  # from 2.9 the extension wants cu{torch's}
    ("2.8.0", "13.0", "transformer-engine-cu12"),  # before 2.9 TE looks for cu12 only
])
def test_torch_extension_without_core_package_is_an_error(te, torch_cuda, core):
    snapshot = replace(NO_CORE, te=te, te_torch=te, torch_cuda=torch_cuda)
    [finding] = environment_findings(snapshot)
    assert (finding.rule, finding.severity) == ("FP8205", "error")
    assert "core package" in finding.message and f"transformer-engine-torch {te}" in \
        finding.message
    words = shlex.split(finding.fix or "")
    assert words[:2] == ["pip", "install"]
    [requirement] = [Requirement(w) for w in words[2:] if not w.startswith("-")]
    assert (requirement.name, str(requirement.specifier)) == (core, f"=={te}")
    assert exit_code([finding], strict=False) == 1  # the doctor is not "ready"


def test_core_package_present_or_a_source_build_is_quiet():
    whole = replace(NO_CORE, te_core="2.18.0", te_core_package="transformer-engine-cu12")
    assert environment_findings(whole) == []
    source_build = replace(NO_CORE, te_torch=None, te_pure_wheel=False)
    assert environment_findings(source_build) == []
