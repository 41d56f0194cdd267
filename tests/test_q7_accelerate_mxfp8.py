"""FP8105's message for `use_mxfp8_block_scaling` on an Accelerate that drops it names MXFP8's
compute-capability range as TE's `_compute_mxfp8_support` has it: 10.0 and above but, from TE
2.6, below 12.0 (pytorch/fp8.py:47-53 at v2.6; pytorch/quantization.py:162-168 at v2.18). It
said "10.0+ (Blackwell)", which an RTX PRO 6000 / RTX 50xx (12.0) meets and TE refuses."""

from __future__ import annotations

from pathlib import Path

from foundry_fp8.lint import accelerate
from foundry_fp8.lint.cli import lint_file

CONFIG = ("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\n"
          "mixed_precision: fp8\nfp8_config:\n  backend: TE\n  use_mxfp8_block_scaling: true\n"
          "num_processes: 2\n")


def test_mxfp8_message_names_te_s_upper_bound(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(accelerate, "installed_accelerate", lambda: (1, 10, 0))
    path = tmp_path / "accelerate.yaml"
    path.write_text(CONFIG)
    [message] = [f["message"] for f in lint_file(path)["findings"] if f["rule"] == "FP8105"]
    assert "compute capability 10.0+ and below 12.0" in message
    assert "TE >= 2.6 refuses 12.0+" in message
