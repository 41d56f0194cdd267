"""Versions an MCLI run config installs (integrations, `pip install` lines, MosaicML images):
the version-dependent rules judge those, not the linting machine's, and say so."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.lint.rules.mcli import pins

CORPUS = Path(__file__).resolve().parent / "lint_corpus"


@pytest.mark.parametrize("text", [
    "transformer_engine[pytorch]==2.8.0", "transformer-engine==1.11.0",
    "Transformer.Engine[pytorch,jax]==2.18.0", "transformer_engine_torch==2.17.0",
    "transformer_engine_cu12==2.5.0", "llm-foundry==0.20.0", "mosaicml==0.31.0",
    "torch==2.7.1",
])
def test_a_pip_packages_pin_is_read_as_pip_reads_it(text):
    data = {"integrations": [{"integration_type": "pip_packages", "packages": ["numpy", text]}]}
    reference = Requirement(text)
    version, = {str(s.version) for s in reference.specifier}
    found = pins(data)
    assert found and {p.version for p in found} == {version}
    assert {p.key for p in found} == {"integrations.0.packages.1"}


@pytest.mark.parametrize(("data", "want"), [
    # unpinned, a range, a moving ref, a repo we do not read: nothing pinned
    ({"integrations": [{"integration_type": "pip_packages",
                        "packages": ["transformer_engine[pytorch]", "torch>=2.6"]}]}, set()),
    ({"integrations": [{"integration_type": "git_repo", "git_repo": "NVIDIA/TransformerEngine",
                        "git_branch": "main"}]}, set()),
    ({"command": "pip install git+https://github.com/NVIDIA/TransformerEngine.git@stable"},
     set()),
    ({"image": "nvcr.io/nvidia/pytorch:24.10-py3"}, set()),
    ({"integrations": [{"integration_type": "git_repo", "git_repo": "NVIDIA/TransformerEngine",
                        "git_branch": "release_v1.11"}]},
     {("te", "1.11", "integrations.0.git_branch")}),  # a source build: one distribution
    ({"command": "pip install --no-build-isolation "
                 "git+https://github.com/NVIDIA/TransformerEngine.git@v2.8\ncomposer train.py"},
     {("te", "2.8", "command")}),
    ({"image": "mosaicml/pytorch:2.1.0_cu121-python3.10-ubuntu20.04",
      "command": "pip install torch==2.7.0\ncomposer train.py"}, {("torch", "2.7.0", "command")}),
    ({"image": "mosaicml/llm-foundry:2.6.0_cu124-latest"}, {("torch", "2.6.0", "image")}),
])
def test_what_counts_as_a_pin(data, want):
    assert {(p.field, p.version, p.key) for p in pins(data)} == want


def test_pinned_te_is_judged_and_named_over_the_machines():
    """The corpus file pins TE 2.18.0: FP8027 warns (TE 2.18 refuses the pickled state) though
    the linting machine has no TE (where it only gives info), and says whose version it read."""
    name = CORPUS / "mcli" / "mcli-te-pinned-mixed.yaml"
    machine = Snapshot(python="3.11", te="2.8.0", te_torch="2.8.0")
    found = {f["rule"]: f for f in lint_file(name, 1, machine)["findings"]}
    assert found["FP8027"]["severity"] == "warning"
    assert "TransformerEngine 2.18.0 as this run config pins it (`integrations.1.packages.0`)" \
        in found["FP8027"]["message"]
    assert "transformer-engine 2.18.0, transformer-engine-torch 2.17.0" \
        in found["FP8205"]["message"]


def test_without_pins_the_te_rules_stay_with_the_machine(tmp_path):
    """The same run config without its pins: no FP8205, and FP8027 judges the machine's TE."""
    data = yaml.safe_load((CORPUS / "mcli" / "mcli-te-pinned-mixed.yaml").read_text())
    del data["integrations"][1]
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    found = {f["rule"]: f for f in lint_file(path, 1, Snapshot(python="3.11"))["findings"]}
    assert "FP8205" not in found and found["FP8027"]["severity"] == "info"
    old_te = Snapshot(python="3.11", te="2.8.0")
    assert "FP8027" not in {f["rule"] for f in lint_file(path, 1, old_te)["findings"]}


@pytest.mark.parametrize("text", [
    "transformer-engine==2.8.0", "transformer_engine[pytorch]==2.8.0",
    "Transformer.Engine[jax,pytorch]==2.8.0", "transformer-engine[jax]==2.8.0",
    "transformer-engine[core_cu12]==2.8.0",
])
def test_te_s_torch_parts_are_pinned_only_with_the_pytorch_extra(text):
    """pip's own reading of the extras (packaging's Requirement) decides: without `pytorch`
    the pin installs the metapackage alone."""
    data = {"integrations": [{"integration_type": "pip_packages", "packages": [text]}]}
    torch_parts = {"te_torch", "te_core"} if "pytorch" in Requirement(text).extras else set()
    assert {p.field for p in pins(data)} == {"te"} | torch_parts


def _run_config(tmp_path: Path, package: str, swap: str) -> tuple[Path, int]:
    """The corpus's te_swap run config with `package` as its pip_packages pin and `swap` as
    te_swap's options; the pin's line."""
    data = yaml.safe_load((CORPUS / "mcli" / "mcli-te-swap-current-old-te.yaml").read_text())
    data["command"] = "cd llm-foundry/scripts\ncomposer train/train.py /mnt/config/parameters.yaml\n"
    data["integrations"].append({"integration_type": "pip_packages", "packages": [package]})
    data["parameters"]["algorithms"]["te_swap"] = yaml.safe_load(swap)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if package in text)
    return path, line


def _te_findings(path: Path) -> list[tuple[str, str, str, int]]:
    return [(f["rule"], f["key"], f["severity"], f["line"])
            for f in lint_file(path, 1, Snapshot(python="3.11"))["findings"]
            if f["rule"].startswith("FP82")]


def test_the_te_metapackage_alone_is_reported_at_its_pin(tmp_path):
    path, line = _run_config(tmp_path, "transformer-engine==2.8.0", "{}")
    assert _te_findings(path) == [("FP8204", "integrations.1.packages.0", "error", line)]
    message = lint_file(path, 1, Snapshot(python="3.11"))["findings"][0]["message"]
    assert "metapackage alone" in message and "2.8.0 as this run config pins it" in message
    with_extra, _ = _run_config(tmp_path, "transformer-engine[pytorch]==2.8.0", "{}")
    assert _te_findings(with_extra) == []
    emulated, _ = _run_config(tmp_path, "transformer-engine==2.8.0", "{backend: emulate}")
    assert _te_findings(emulated) == []  # nothing imports TE


@pytest.mark.parametrize("version", ["1.11.0", "1.12.0", "2.8.0"])
def test_a_pinned_te_below_te_swaps_floor_is_reported(tmp_path, version):
    """te_swap's require_te (foundry_fp8/te/backend.py) is the reference: it refuses the pinned
    version exactly when the linter reports it."""
    from unittest import mock

    from foundry_fp8.te import backend, probe
    from foundry_fp8.te.facts import parse_version

    path, line = _run_config(tmp_path, f"transformer-engine[pytorch]=={version}",
                             "{backend: te}")
    with mock.patch.object(probe, "te_available", return_value=True), \
            mock.patch.object(probe, "te_version", return_value=parse_version(version)):
        try:
            backend.require_te()
            refused = False
        except RuntimeError:
            refused = True
    want = [("FP8204", "integrations.1.packages.0", "error", line)] if refused else []
    assert _te_findings(path) == want
    if refused:
        message = lint_file(path, 1, Snapshot(python="3.11"))["findings"][0]["message"]
        assert f"TransformerEngine {version} as this run config pins it" in message
