"""FP8121/FP8122/FP8124 and MS-AMP under DeepSpeed (FP8103): each verdict is checked against
Accelerate's own DeepSpeedPlugin / MSAMPRecipeKwargs, run on CPU with the environment the launcher
would export for the same config (its setup_fp8_env)."""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry_fp8.lint.accelerate import lint_accelerate, lint_input
from foundry_fp8.lint.cli import lint_file

accelerate = pytest.importorskip("accelerate")
from accelerate.utils import DeepSpeedPlugin, MSAMPRecipeKwargs  # noqa: E402
from accelerate.utils.launch import setup_fp8_env  # noqa: E402

RULES = ("FP8103", "FP8121", "FP8122")


def launch_env(acc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The training process's environment for this config, as `accelerate launch` sets it:
    setup_fp8_env for fp8_config (keys given the fp8_ prefix, as _validate_launch_command does)
    and the ZeRO stage prepare_deepspeed_cmd_env exports."""
    for name in [n for n in os.environ if n.startswith("ACCELERATE_")]:
        monkeypatch.delenv(name)
    args = {k if k.startswith("fp8") else f"fp8_{k}": v
            for k, v in acc.get("fp8_config", {}).items()}
    for name, value in setup_fp8_env(argparse.Namespace(**args), {}).items():
        monkeypatch.setenv(name, value)
    stage = acc.get("deepspeed_config", {}).get("zero_stage")
    if stage is not None:
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", str(stage))


def plugin_error(ds: dict[str, Any] | None) -> str | None:
    """What Accelerate's DeepSpeedPlugin raises for this DeepSpeed JSON (None: nothing)."""
    try:
        DeepSpeedPlugin(hf_ds_config=ds) if ds is not None else DeepSpeedPlugin()
    except (ValueError, NotImplementedError) as e:
        return type(e).__name__
    return None


def lint(tmp_path: Path, acc: dict[str, Any], ds: dict[str, Any] | None
         ) -> list[tuple[str, str, int]]:
    if ds is not None:
        (tmp_path / "ds.json").write_text(json.dumps(ds, indent=2))
        acc = {**acc, "deepspeed_config": {**acc.get("deepspeed_config", {}),
                                           "deepspeed_config_file": "ds.json"}}
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(acc, sort_keys=False))
    entry = lint_file(path)
    assert entry["error"] is None, entry["error"]
    return [(f["rule"], f["key"], f["line"]) for f in entry["findings"]
            if f["rule"] in RULES and f["severity"] == "error"]


BASE = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED"}
FP8 = {**BASE, "mixed_precision": "fp8"}
MSAMP = {"backend": "MSAMP", "opt_level": "O2"}
Z2 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
Z3 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}

CASES = {
    # (Accelerate config, DeepSpeed JSON or None, the error findings expected)
    "yaml-zero3-msamp": ({**FP8, "deepspeed_config": {"zero_stage": 3}, "fp8_config": MSAMP},
                         None, [("FP8122", "deepspeed_config.zero_stage", 5)]),
    "yaml-zero2-msamp": ({**FP8, "deepspeed_config": {"zero_stage": 2}, "fp8_config": MSAMP},
                         None, []),
    "yaml-msamp-O3": ({**FP8, "deepspeed_config": {"zero_stage": 2},
                       "fp8_config": {"backend": "MSAMP", "opt_level": "O3"}},
                      None, [("FP8122", "fp8_config.opt_level", 8)]),
    "yaml-msamp-lowercase-o2": ({**FP8, "deepspeed_config": {"zero_stage": 1},
                                 "fp8_config": {"backend": "MSAMP", "opt_level": "o2"}},
                                None, [("FP8122", "fp8_config.opt_level", 8)]),
    "file-zero3-msamp": ({**BASE, "fp8_config": MSAMP}, Z3,
                         [("FP8122", "deepspeed_config.deepspeed_config_file", 7)]),
    "file-zero3-string-stage": ({**BASE, "fp8_config": MSAMP},
                                {"zero_optimization": {"stage": "3"}}, []),
    "file-zero3-own-msamp-block": ({**BASE, "fp8_config": MSAMP},
                                   {**Z3, "msamp": {"enabled": True, "opt_level": "O1"}}, []),
    "file-zero3-backend-lowercase": ({**BASE, "fp8_config": {"backend": "msamp"}}, Z3, []),
    "file-zero-auto": ({**BASE, "fp8_config": MSAMP},
                       {"zero_optimization": {"stage": "auto"}}, []),
    "file-no-zero-optimization": (BASE, {"bf16": {"enabled": "auto"},
                                         "train_micro_batch_size_per_gpu": "auto"},
                                  [("FP8121", "deepspeed_config.deepspeed_config_file", 4)]),
}


@pytest.mark.parametrize("name", CASES)
def test_msamp_and_zero_verdicts_match_deepspeed_plugin(name, tmp_path, monkeypatch):
    acc, ds, expected = CASES[name]
    launch_env(acc, monkeypatch)
    refused = plugin_error(ds)
    assert lint(tmp_path, acc, ds) == expected
    assert (refused is not None) == bool(expected), refused


def test_deepspeed_json_alone_without_zero_is_a_warning(tmp_path):
    """DeepSpeed alone accepts the file; Accelerate refuses it."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "bf16": {"enabled": True}}, indent=2))
    hits = [(f["key"], f["line"], f["severity"]) for f in lint_file(path)["findings"]
            if f["rule"] == "FP8121"]
    assert hits == [("train_batch_size", 2, "warning")]
    path.write_text(json.dumps(Z2))
    assert not [f for f in lint_file(path)["findings"] if f["rule"] == "FP8121"]


def test_msamp_under_deepspeed_is_not_called_bf16_only(tmp_path, monkeypatch):
    """DeepSpeedPlugin turns MS-AMP on from ACCELERATE_FP8_BACKEND=MSAMP whatever the mixed
    precision AcceleratorState reports, so FP8103's 'trains in BF16' is wrong there; it stays
    for the TE backend, which the plugin leaves off."""
    acc = {**FP8, "deepspeed_config": {"zero_stage": 2}, "fp8_config": MSAMP}
    launch_env(acc, monkeypatch)
    assert DeepSpeedPlugin().deepspeed_config["msamp"] == {"enabled": True, "opt_level": "O2"}
    assert lint(tmp_path, acc, None) == []
    acc = {**acc, "fp8_config": {"backend": "TE"}}
    launch_env(acc, monkeypatch)
    assert "msamp" not in DeepSpeedPlugin().deepspeed_config
    assert [r for r, _, _ in lint(tmp_path, acc, None)] == ["FP8103"]


@pytest.mark.parametrize(("level", "version", "severity"), [
    ("O3", (1, 9, 0), "error"), ("o1", (1, 14, 0), "error"), ("O3", (1, 2, 0), "error"),
    ("O3", None, "warning"), ("O3", (1, 8, 1), None), ("O2", (1, 9, 0), None)])
def test_msamp_opt_level_outside_deepspeed(level, version, severity, monkeypatch):
    """1.9+ and 1.0-1.3 build MS-AMP's recipe from backend MSAMP; 1.4-1.8 pick by what is
    installed (FP8115), so nothing is said there. Reference: MSAMPRecipeKwargs itself."""
    acc = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU",
           "mixed_precision": "fp8", "fp8_config": {"backend": "MSAMP", "opt_level": level}}
    launch_env(acc, monkeypatch)
    try:
        MSAMPRecipeKwargs()
        refused = False
    except ValueError:
        refused = True
    hits = [(f.key, f.severity) for f in lint_accelerate(lint_input(acc, version=version))
            if f.rule == "FP8122"]
    assert refused == (level not in ("O1", "O2"))
    assert hits == ([("fp8_config.opt_level", severity)] if severity else [])


def _calls(node: ast.AST) -> set[str]:
    return {n.func.attr for n in ast.walk(node)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}


def test_msamp_under_fsdp2_is_never_applied_by_accelerate():
    """Reference: the installed Accelerate's own prepare(): the FSDP2 branch calls
    _prepare_fsdp2, which never calls _prepare_msamp (only the plain branch does)."""
    from accelerate import Accelerator

    tree = ast.parse(textwrap.dedent(inspect.getsource(Accelerator.prepare)))
    branch = next(n for n in ast.walk(tree) if isinstance(n, ast.If)
                  and "is_fsdp2" in ast.unparse(n.test) and "_prepare_fsdp2" in _calls(n))
    assert "_prepare_msamp" not in _calls(ast.Module(branch.body, []))
    assert "_prepare_msamp" in _calls(ast.Module(branch.orelse, []))
    fsdp2 = ast.parse(textwrap.dedent(inspect.getsource(Accelerator._prepare_fsdp2)))
    assert "_prepare_msamp" not in _calls(fsdp2) and "msamp" not in ast.unparse(fsdp2)

    acc = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
           "mixed_precision": "fp8", "fp8_config": {"backend": "MSAMP"},
           "fsdp_config": {"fsdp_version": 2, "fsdp_cpu_ram_efficient_loading": False}}
    hits = lambda acc, version: [(f.key, f.severity) for f in lint_accelerate(  # noqa: E731
        lint_input(acc, version=version)) if f.rule == "FP8124"]
    assert hits(acc, (1, 9, 0)) == [("fsdp_config.fsdp_version", "error")]
    assert hits(acc, None) == [("fsdp_config.fsdp_version", "warning")]
    assert hits(acc, (1, 8, 1)) == []  # the backend is not read: MS-AMP only by what is installed
    # FSDP1 too (Accelerate's default version): the raise's only condition is distributed_type
    assert hits({**acc, "fsdp_config": {"version": 1}}, (1, 9, 0)) == [("fsdp_config.version",
                                                                          "error")]
    assert hits({**acc, "fsdp_config": {}}, (1, 14, 0)) == [("distributed_type", "error")]
    assert hits({**acc, "fp8_config": {"backend": "TE"}}, (1, 9, 0)) == []
