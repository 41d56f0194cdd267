"""`foundry-fp8 bench` on machines that cannot run it as they are (QA Q5, session 22): the one
line names the cause a user can act on, not only "no CUDA GPU"."""

from __future__ import annotations

import json
import os

import pytest
import torch

from foundry_fp8.cli import main
from foundry_fp8.environment import hides_every_gpu, visible_gpus
from foundry_fp8.tools import bench


def _no_gpu_line(monkeypatch, capsys, tmp_path, cuda: str | None, visible: str | None) -> str:
    """The bench's stderr where torch sees no GPU: torch's CUDA build `cuda`, and
    CUDA_VISIBLE_DEVICES=`visible` (None: unset)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(bench, "run_bench", lambda *a, **k: pytest.fail("ran"))
    assert main(["bench", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize("visible", ["", "-1", "0,0", "none"])
def test_a_cuda_visible_devices_that_hides_every_gpu_is_named(monkeypatch, capsys, tmp_path,
                                                              visible):
    """An H100 box with CUDA_VISIBLE_DEVICES='' or '-1': the old line said "no CUDA GPU; use
    --tiny", sending the user to the CPU path on a GPU machine."""
    err = _no_gpu_line(monkeypatch, capsys, tmp_path, "12.6", visible)
    assert f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU" in err
    assert "unset it" in err


@pytest.mark.parametrize("visible", [None, "0", "GPU-8f6a"])
def test_no_gpu_without_a_hiding_variable_blames_none(monkeypatch, capsys, tmp_path, visible):
    """A CPU laptop (or an ordinal/UUID that may name a real GPU): no variable is blamed, and
    the doctor is named for the why."""
    err = _no_gpu_line(monkeypatch, capsys, tmp_path, "12.6", visible)
    assert "CUDA_VISIBLE_DEVICES" not in err and "foundry-fp8 doctor" in err
    assert "use --tiny for the CPU path" in err


def test_torch_s_cpu_build_is_named(monkeypatch, capsys, tmp_path):
    """torch's CPU build sees no GPU even on an H100: the line says so (torch/version.py
    `cuda = None`), before blaming any variable."""
    err = _no_gpu_line(monkeypatch, capsys, tmp_path, None, "-1")
    assert f"torch {torch.__version__}, its CPU build" in err
    assert "install a CUDA build of torch" in err and "CUDA_VISIBLE_DEVICES" not in err


@pytest.mark.parametrize(("value", "hidden"), [("", True), ("-1", True), ("0,0", True),
                                               ("x", True), ("0", False), ("1,-1", False),
                                               ("GPU-8f6a", False), ("MIG-1", False)])
def test_hides_every_gpu_agrees_with_the_doctor_s_reading(value, hidden):
    """One reading of CUDA_VISIBLE_DEVICES (torch's): what hides every GPU hides them from any
    machine the doctor's `visible_gpus` counts for."""
    assert hides_every_gpu(value) is hidden
    if not value.startswith(("GPU-", "MIG-")):
        assert hidden == all(visible_gpus(value, n) == 0 for n in (1, 2, 8))


def test_a_variant_failing_on_an_nvte_variable_names_it(monkeypatch, capsys, tmp_path):
    """NVTE_DEBUG=true: TE reads it with int() as it imports (pytorch/attention/
    dot_product_attention/utils.py:63 at v2.18), and Composer's import of TE lets the ValueError
    through (composer/core/precision.py catches ImportError only), so every variant fails with
    "invalid literal for int() with base 10: 'true'", which names no variable."""
    monkeypatch.setenv("NVTE_DEBUG", "true")

    def te_import(*_args, **_kwargs):
        return int(os.getenv("NVTE_DEBUG", "0"))  # TE's own line

    monkeypatch.setattr(bench, "run_variant", te_import)
    assert main(["bench", "--tiny", "--variants", "bf16", "--out", str(tmp_path)]) == 1
    [failed] = json.loads((tmp_path / "mpt-tiny-cpu.json").read_text())["failed"]
    assert failed["reason"] == ("ValueError: invalid literal for int() with base 10: 'true' "
                                "(NVTE_DEBUG: TE reads it as an integer)")
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"foundry-fp8 bench: bf16 failed: {failed['reason']}")
