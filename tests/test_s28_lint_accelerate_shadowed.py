"""An `accelerate` folder that shadows the installed Accelerate (PYTHONPATH, a checkout) is what
runs: the Accelerate rules judge its `__version__`, not the installed 1.8.1's metadata. Before,
a 1.13 checkout's config got 1.8.1's verdicts (FP8105: pad_inner_dim 'silently dropped')."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
AO = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: fp8
fsdp_config:
  fsdp_version: 2
  fsdp_cpu_ram_efficient_loading: false
fp8_config:
  backend: AO
  pad_inner_dim: true
num_processes: 8
"""


def _env(*paths: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [REPO, *paths]))}


def _fp8105(tmp_path: Path, *paths: Path) -> list[str]:
    config = tmp_path / "ao.yaml"
    config.write_text(AO)
    done = subprocess.run(
        [sys.executable, "-m", "foundry_fp8", "lint", "--format", "json", str(config)],
        capture_output=True,
        text=True,
        env=_env(*paths),
    )
    findings = json.loads(done.stdout)["files"][0]["findings"]
    return [f["key"] for f in findings if f["rule"] == "FP8105"]


@pytest.mark.parametrize(("version", "dropped"), [("1.13.0", False), ("1.12.0", True)])
def test_a_shadowing_checkout_is_judged_by_its_own_version(
    tmp_path: Path, version: str, dropped: bool
):
    shadow = tmp_path / "src"
    (shadow / "accelerate").mkdir(parents=True)
    (shadow / "accelerate" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    runs = subprocess.run(
        [
            sys.executable,
            "-c",
            "import accelerate, importlib.metadata as m; "
            "print(accelerate.__version__, m.version('accelerate'))",
        ],
        capture_output=True,
        text=True,
        env=_env(shadow),
    ).stdout.split()
    assert runs == [version, "1.8.1"]  # the reference: Python runs the folder's
    assert _fp8105(tmp_path, shadow) == (["fp8_config.pad_inner_dim"] if dropped else [])


def test_without_a_shadow_the_installed_version(tmp_path: Path):
    assert _fp8105(tmp_path) == ["fp8_config.pad_inner_dim"]
