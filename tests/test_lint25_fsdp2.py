"""FP8103 under Accelerate's FSDP2 (`fsdp_version: 2`) with FP8 on TransformerEngine: from 1.8
prepare() converts the layers to TE, then takes _prepare_fsdp2, which never wraps the forward in
TE's fp8_autocast, so the run trains without FP8 and without an error; checked by running the
installed Accelerate's own code."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from foundry_fp8.lint.accelerate import installed_accelerate, lint_accelerate, lint_input
from foundry_fp8.lint.cli import lint_file

FSDP2 = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: fp8
fp8_config:
  fp8_format: HYBRID
  amax_history_len: 32
fsdp_config:
  fsdp_version: {version}
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: false
  fsdp_activation_checkpointing: {checkpointing}
num_processes: 8
"""

#: Accelerate's own prepare_model (FSDP1, DDP, one process) and _prepare_fsdp2, with TE's
#: availability stood in and apply_fp8_autowrap, the one call that enters TE's fp8_autocast,
#: recorded. FSDP2's sharding (fsdp2_prepare_model) needs a process group: stood in by identity.
SCRIPT = """\
import types
from unittest import mock
import torch
import accelerate.accelerator as A, accelerate.state as S, accelerate.utils.dataclasses as D
from accelerate.utils import DynamoBackend
calls = []
with mock.patch.object(S, "is_fp8_available", lambda: True), \\
        mock.patch.object(A, "is_torchao_available", lambda: False), \\
        mock.patch.object(A, "is_transformer_engine_available", lambda: True), \\
        mock.patch.object(D, "is_transformer_engine_available", lambda: True), \\
        mock.patch.object(A, "apply_fp8_autowrap", lambda m, h: calls.append(m) or m), \\
        mock.patch.object(A, "fsdp2_prepare_model", lambda a, m: m), \\
        mock.patch.object(A, "fsdp2_switch_optimizer_parameters", lambda o, m: None):
    acc = A.Accelerator(mixed_precision="fp8", cpu=True)
    assert acc.fp8_backend == "TE", acc.fp8_backend
    acc.prepare_model(torch.nn.Linear(16, 16))
    print("prepare_model", len(calls))
    model = torch.nn.Linear(16, 16)
    plugin = types.SimpleNamespace(set_auto_wrap_policy=lambda m: None,
                                   activation_checkpointing=False)
    acc.state.fsdp_plugin = plugin
    acc.state.dynamo_plugin = types.SimpleNamespace(backend=DynamoBackend.NO)
    A.Accelerator._prepare_fsdp2(acc, model, torch.optim.SGD(model.parameters(), lr=0.1))
    print("_prepare_fsdp2", len(calls) - 1)
"""


LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE",
                      "MV2_COMM_WORLD_SIZE")


def test_the_installed_accelerates_fsdp2_path_never_enters_te_autocast():
    version = installed_accelerate()
    if version is None or version < (1, 8):
        pytest.skip("Accelerate 1.8+ (the release with _prepare_fsdp2)")
    # One process: a launcher's variables left by an earlier test (Composer's dist init sets
    # WORLD_SIZE, RANK, ...) would make Accelerate rendezvous for several
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARIABLES and not k.startswith("ACCELERATE_")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          check=False, timeout=120, env=env)
    assert done.stdout.split() == ["prepare_model", "1", "_prepare_fsdp2", "0"], \
        done.stderr[-2000:]


def found(tmp_path: Path, body: str, rule: str) -> list[tuple[str, int, str]]:
    path = tmp_path / "accelerate.yaml"
    path.write_text(textwrap.dedent(body))
    entry = lint_file(path)
    assert entry["error"] is None
    return [(f["key"], f["line"], f["severity"]) for f in entry["findings"] if f["rule"] == rule]


def test_fsdp2_with_te_is_fp8103_at_fsdp_version(tmp_path: Path):
    if installed_accelerate() is None or installed_accelerate() < (1, 8):
        pytest.skip("judged against Accelerate 1.8+")
    body = FSDP2.format(version=2, checkpointing="false")
    assert found(tmp_path, body, "FP8103") == [("fsdp_config.fsdp_version", 8, "error")]


def test_fsdp1_is_not_reported_and_keeps_fp8119(tmp_path: Path):
    body = FSDP2.format(version=1, checkpointing="true")
    assert found(tmp_path, body, "FP8103") == []
    assert found(tmp_path, body, "FP8119") == [("fsdp_config.fsdp_activation_checkpointing",
                                                11, "error")]


def test_fsdp2_checkpointing_is_not_fp8119(tmp_path: Path):
    """No autocast at all under FSDP2: FP8103 says so, not a recompute outside it."""
    if installed_accelerate() is None or installed_accelerate() < (1, 8):
        pytest.skip("judged against Accelerate 1.8+")
    assert found(tmp_path, FSDP2.format(version=2, checkpointing="true"), "FP8119") == []


def _fp8103(config: dict, version: tuple[int, ...] | None, torchao: bool = False) -> list:
    return [(f.key, f.severity) for f in lint_accelerate(
        lint_input(config, version=version, torchao=torchao)) if f.rule == "FP8103"]


BASE = {"distributed_type": "FSDP", "mixed_precision": "fp8"}


@pytest.mark.parametrize(("config", "version", "torchao", "expected"), [
    ({"fsdp_config": {"fsdp_version": 2}}, (1, 8, 1), False,
     [("fsdp_config.fsdp_version", "error")]),
    ({"fsdp_config": {"version": "2"}, "fp8_config": {"backend": "TE"}}, (1, 14, 0), False,
     [("fsdp_config.version", "error")]),
    ({"fsdp_config": {"fsdp_version": 2}}, None, False,
     [("fsdp_config.fsdp_version", "warning")]),
    # 1.6-1.7 took FSDP2 through prepare_model, and run no FP8 from the config for another reason
    ({"fsdp_config": {"fsdp_version": 2}}, (1, 7, 0), False, [("mixed_precision", "error")]),
    # torchao: Accelerate's FSDP2 FP8 path
    ({"fsdp_config": {"fsdp_version": 2}, "fp8_config": {"backend": "AO"}}, (1, 14, 0), False,
     []),
    ({"fsdp_config": {"fsdp_version": 2}}, (1, 8, 1), True, []),
    ({"fsdp_config": {"fsdp_version": 1}}, (1, 14, 0), False, []),
    ({"fsdp_config": {}}, (1, 14, 0), False, []),
])
def test_fsdp2_by_release_and_backend(config, version, torchao, expected):
    assert _fp8103({**BASE, **config}, version, torchao) == expected
