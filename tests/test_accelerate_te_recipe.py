"""FP8123 (fp8_config values TERecipeKwargs cannot read) and FP8107's reading of fp8_format /
amax_compute_algo as Accelerate case-folds them: each verdict against Accelerate's own
TERecipeKwargs, built on CPU from the environment its setup_fp8_env exports for the config."""

from __future__ import annotations

import argparse
import os
from typing import Any

import pytest

from foundry_fp8.lint.accelerate import installed_accelerate, lint_accelerate, lint_input

pytest.importorskip("accelerate")
import accelerate.utils.dataclasses as acc_dataclasses  # noqa: E402
from accelerate.utils.launch import setup_fp8_env  # noqa: E402


def te_recipe_error(fp8_config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> bool:
    """Does Accelerate's TERecipeKwargs() raise for the variables the launcher exports for this
    fp8_config (TE itself is not installed here: its availability check is answered yes)?"""
    for name in [n for n in os.environ if n.startswith("ACCELERATE_")]:
        monkeypatch.delenv(name)
    args = {k if k.startswith("fp8") else f"fp8_{k}": v for k, v in fp8_config.items()}
    for name, value in setup_fp8_env(argparse.Namespace(**args), {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(acc_dataclasses, "is_transformer_engine_available", lambda: True)
    try:
        acc_dataclasses.TERecipeKwargs()
    except ValueError:
        return True
    return False


def errors(fp8_config: dict[str, Any], distributed: str = "MULTI_GPU",
           version: tuple[int, ...] = (1, 9, 0)) -> list[tuple[str, str]]:
    acc = {"compute_environment": "LOCAL_MACHINE", "distributed_type": distributed,
           "mixed_precision": "fp8", "fp8_config": fp8_config}
    return [(f.rule, f.key) for f in lint_accelerate(lint_input(acc, version=version))
            if f.severity == "error" and f.rule in ("FP8107", "FP8123")]


@pytest.mark.parametrize(("written", "expected"), [
    ({"margin": 0.5}, [("FP8123", "fp8_config.margin")]),
    ({"interval": 1.0}, [("FP8123", "fp8_config.interval")]),
    ({"fp8_amax_history_len": "1e3"}, [("FP8123", "fp8_config.fp8_amax_history_len")]),
    ({"amax_history_len": 16.0}, [("FP8123", "fp8_config.amax_history_len")]),
    ({"margin": True}, [("FP8123", "fp8_config.margin")]),
    ({"use_autocast_during_eval": "maybe"}, [("FP8123", "fp8_config.use_autocast_during_eval")]),
    ({"fp8_format": "HYBRID "}, [("FP8123", "fp8_config.fp8_format")]),
    ({"fp8_format": "MXFP8"}, [("FP8123", "fp8_config.fp8_format")]),
    ({"amax_compute_algo": "MAX"}, []),
    ({"amax_compute_algo": "Max", "fp8_format": "e4m3"}, []),
    ({"use_autocast_during_eval": "on", "amax_history_len": "1_024", "margin": " 1"}, []),
    ({"amax_history_len": 16, "margin": 1, "fp8_format": "HYBRID"}, []),
])
def test_te_recipe_values_as_terecipekwargs_reads_them(written, expected, monkeypatch):
    assert errors({"backend": "TE", **written}) == expected
    assert te_recipe_error({"backend": "TE", **written}, monkeypatch) == bool(expected)


def test_not_under_deepspeed_before_1_11():
    """No TERecipeKwargs is built from the config there (FP8103 says so); from 1.11 it is."""
    assert errors({"margin": 0.5}, distributed="DEEPSPEED", version=(1, 10, 0)) == []
    assert errors({"margin": 0.5}, distributed="DEEPSPEED", version=(1, 11, 0)) == [
        ("FP8123", "fp8_config.margin")]


@pytest.mark.parametrize("written", [
    {"margin": None, "interval": None},
    {"fp8_format": None, "amax_compute_algo": None, "amax_history_len": None},
    {"use_autocast_during_eval": None, "use_mxfp8_block_scaling": None},
    {"margin": 0.5, "fp8_margin": None},  # the later null unsets the argument: nothing exported
])
def test_null_values_are_not_exported_so_not_judged(written, monkeypatch):
    """`margin: null` / an empty `interval:`: setup_fp8_env exports no variable for a None, so
    TERecipeKwargs keeps its defaults (no FP8123, and no FP8107 for a value TE never gets)."""
    assert te_recipe_error({"backend": "TE", **written}, monkeypatch) is False
    assert errors({"backend": "TE", **written}) == []
    assert errors({"backend": "TE", **written}, version=(1, 11, 0)) == []


def test_mxfp8_flag_read_only_from_1_11(monkeypatch):
    """TERecipeKwargs has no use_mxfp8_block_scaling before 1.11, so a bad value raises nothing
    there (the installed release is the reference); from 1.11 str_to_bool reads it."""
    version = installed_accelerate()
    assert version is not None and version < (1, 11)
    written = {"backend": "TE", "use_mxfp8_block_scaling": "maybe"}
    assert te_recipe_error(written, monkeypatch) is False
    assert errors(written, version=version) == []
    assert errors(written, version=(1, 11, 0)) == [
        ("FP8123", "fp8_config.use_mxfp8_block_scaling")]
