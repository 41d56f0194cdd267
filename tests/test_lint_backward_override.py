"""FP8211: NVTE_BACKWARD_OVERRIDE against what TransformerEngine does with it. Reference: TE's
transformer_engine/common/recipe/__init__.py at v2.15 (the first tag that reads it; v2.14 has no
`backward_override`): `_BACKWARD_OVERRIDES = ("high_precision", "dequantized")` (l. 14), the
field's default `os.getenv("NVTE_BACKWARD_OVERRIDE", None)` (l. 219), every recipe's
`__post_init__` asserting it is None or one of those (l. 224-225: '' is refused), and
DelayedScaling's asserting it is None (l. 226-228). Composer's fp8_autocast, under which
LLM-Foundry's own TE layers run, builds DelayedScaling by default
(composer/core/precision.py get_precision_context)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.rules.environment import environment_findings

H100 = Snapshot(python="3.11.7", torch="2.7.0", torch_cuda="12.6", gpu_name="NVIDIA H100",
                capability=(9, 0), te="2.20.2", te_torch="2.20.2", te_core="2.20.2",
                te_core_package="transformer-engine-cu12", te_import_checked=True)
OLD_TE = replace(H100, te="2.14.1", te_torch="2.14.1", te_core="2.14.1")
CPU = Snapshot(python="3.11.7", torch="2.7.0")

CURRENT = {"precision": "amp_fp8",
           "algorithms": {"te_swap": {"backend": "te", "fp8_recipe": {"scaling": "current"}}}}
DELAYED = {"precision": "amp_fp8", "algorithms": {"te_swap": {"backend": "te"}}}
NATIVE = {"precision": "amp_fp8", "model": {"name": "mpt_causal_lm", "fc_type": "te"}}
EMULATED_CURRENT = {"precision": "amp_fp8", "algorithms": {"te_swap": {
    "backend": "emulate", "fp8_recipe": {"scaling": "current"}}}}
BF16 = {"precision": "amp_bf16", "model": {"name": "mpt_causal_lm"}}


def fp8211(snapshot: Snapshot, value: str | None, config: dict | None = None) -> list[str]:
    found = environment_findings(replace(snapshot, nvte_backward_override=value), config)
    return [f.severity for f in found if f.rule == "FP8211"]


@pytest.mark.parametrize("value", ["bogus", "", "1", "HIGH_PRECISION"])
def test_a_value_te_refuses_is_an_error_everywhere(value):
    assert fp8211(H100, value) == ["error"]  # the doctor
    assert fp8211(CPU, value) == ["error"]  # no TE: the emulated backend refuses it too
    assert fp8211(H100, value, CURRENT) == ["error"]
    assert fp8211(CPU, value, EMULATED_CURRENT) == ["error"]


@pytest.mark.parametrize("value", ["high_precision", "dequantized"])
def test_an_accepted_value_fails_delayed_scaling_only(value):
    assert fp8211(H100, value) == ["warning"]  # the doctor does not know the recipe
    assert fp8211(H100, value, DELAYED) == ["error"]
    assert fp8211(H100, value, NATIVE) == ["error"]  # Composer's default DelayedScaling
    assert fp8211(H100, value, CURRENT) == []
    assert fp8211(CPU, value, EMULATED_CURRENT) == []


def test_te_before_2_15_ignores_it():
    assert fp8211(OLD_TE, "high_precision") == ["info"]
    assert fp8211(OLD_TE, "bogus", DELAYED) == ["info"]
    message = environment_findings(replace(OLD_TE, nvte_backward_override="bogus"))[0].message
    assert "ignored by TransformerEngine 2.14.1" in message


def test_unset_or_a_run_without_fp8_says_nothing():
    assert fp8211(H100, None) == []
    assert fp8211(H100, None, DELAYED) == []
    assert fp8211(H100, "bogus", BF16) == []


def _doctor(tmp_path, value: str) -> subprocess.CompletedProcess:
    info = tmp_path / "transformer_engine-2.20.2.dist-info"  # TE's version, for the doctor
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer_engine\n"
                                   "Version: 2.20.2\n")
    env = {**os.environ, "NVTE_BACKWARD_OVERRIDE": value, "PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "doctor", "--no-te-import"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)


def test_the_doctor_fails_on_a_refused_value(tmp_path):
    done = _doctor(tmp_path, "bogus")
    assert done.returncode == 1, done.stdout
    assert "ready for FP8 training" not in done.stdout
    assert "error FP8211 NVTE_BACKWARD_OVERRIDE: NVTE_BACKWARD_OVERRIDE='bogus'" in done.stdout
    assert done.stdout.splitlines()[-1].startswith("foundry-fp8 doctor: exit 1 because of 1 "
                                                   "error: FP8211")
