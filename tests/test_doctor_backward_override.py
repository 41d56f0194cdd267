"""The doctor's NVTE_BACKWARD_OVERRIDE row: shown only where the variable is set, with what the
installed TE does with it. TE reads it from v2.15 (the first tag whose
transformer_engine/common/recipe/__init__.py has it; v2.14 has no `backward_override`), takes
`high_precision` and `dequantized` (`_BACKWARD_OVERRIDES`, l. 14 at v2.15) and refuses any
other value, the empty one too (`os.getenv` returns '', not None: l. 219, 224-225)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from foundry_fp8.environment import gather_snapshot


def _doctor_rows(tmp_path, override: str | None, te: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NVTE_BACKWARD_OVERRIDE"}
    if override is not None:
        env["NVTE_BACKWARD_OVERRIDE"] = override
    if te is not None:  # a TE distribution's metadata, so the doctor reads its version
        info = tmp_path / f"transformer_engine-{te}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: transformer_engine\n"
                                       f"Version: {te}\n")
        env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "doctor", "--no-te-import"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert "Traceback" not in done.stderr, done.stderr
    return dict(line.split(None, 1) for line in done.stdout.splitlines()
                if line.startswith(("NVTE_", "TransformerEngine")))


@pytest.mark.parametrize(("override", "te", "row"), [
    ("high_precision", "2.15.0", "'high_precision': read by TransformerEngine 2.15.0 and the "
     "emulated backend: current scaling's backward without FP8 (gradients not cast; dgrad and "
     "wgrad from the weight and input as stored); delayed scaling and te.LayerNormMLP refuse it"),
    ("dequantized", None, "'dequantized': read by TransformerEngine >= 2.15 and the emulated "
     "backend: current scaling's backward without FP8 (gradients not cast; dgrad and wgrad from "
     "the weight and input's FP8 copies, dequantized); delayed scaling and te.LayerNormMLP "
     "refuse it"),
    ("high_precision", "2.14.1", "'high_precision': ignored by TransformerEngine 2.14.1 (read from"
     " 2.15); the emulated backend reads it"),
    ("", "2.20.2", "'': refused by TransformerEngine 2.20.2 and the emulated backend: any FP8 "
     "recipe raises (it takes high_precision or dequantized)"),
    ("1", "2.20.2", "'1': refused by TransformerEngine 2.20.2 and the emulated backend: any FP8 "
     "recipe raises (it takes high_precision or dequantized)"),
])
def test_the_doctor_says_what_the_variable_does(tmp_path, override, te, row):
    rows = _doctor_rows(tmp_path, override, te)
    assert rows["NVTE_BACKWARD_OVERRIDE"].strip() == row


def test_unset_it_has_no_row_and_the_json_says_none(tmp_path):
    assert "NVTE_BACKWARD_OVERRIDE" not in _doctor_rows(tmp_path, None, "2.20.2")
    os.environ.pop("NVTE_BACKWARD_OVERRIDE", None)
    assert gather_snapshot(probe_te_import=False, probe_gpu=False).nvte_backward_override is None


def test_the_json_environment_holds_the_value(monkeypatch):
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    done = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "doctor", "--no-te-import",
                           "--format", "json"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert json.loads(done.stdout)["environment"]["nvte_backward_override"] == "dequantized"


def test_a_long_value_is_cut_in_its_row(tmp_path):
    row = _doctor_rows(tmp_path, "x" * 500, None)["NVTE_BACKWARD_OVERRIDE"].strip()
    assert row == "'" + "x" * 76 + "...: refused by TransformerEngine >= 2.15 and the emulated " \
        "backend: any FP8 recipe raises (it takes high_precision or dequantized)"
