"""FP8216: a flash-attn that is installed but does not import after torch (built for another
torch: "undefined symbol") is absent to LLM-Foundry, whose is_flash_v2_installed() catches every
exception: MPT's default attn_impl flash then dies at the first forward and its default loss at
build, with messages that say flash-attn is not installed. The doctor tries the import in a
subprocess, as it tries TE's. A stand-in flash_attn package (its metadata and __init__) on
PYTHONPATH plays the broken and the healthy build; LLM-Foundry's own check is the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: A build for another torch: llmfoundry/__init__.py's own check makes `import llmfoundry` fail.
BROKEN = (
    "raise ImportError('/x/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined "
    "symbol: _ZN3c104cuda9SetDeviceEi')\n"
)
#: A build for another CUDA: that check passes it, and is_flash_v2_installed() says False.
OTHER_CUDA = (
    "raise ImportError('libcudart.so.12: cannot open shared object file: No such file or "
    "directory')\n"
)
HEALTHY = "__version__ = '2.7.4'\n"


def _site(tmp_path: Path, init: str) -> Path:
    site = tmp_path / "site"
    (site / "flash_attn").mkdir(parents=True)
    (site / "flash_attn" / "__init__.py").write_text(init)
    info = site / "flash_attn-2.7.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flash-attn\nVersion: 2.7.4\n")
    return site


def _run(site: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(site)]),
        "PATH": "/usr/bin:/bin",
    }
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize(
    ("init", "severity"), [(BROKEN, "error"), (OTHER_CUDA, "warning"), (HEALTHY, None)]
)
def test_the_doctor_tries_the_import(tmp_path: Path, init: str, severity: str | None):
    site = _site(tmp_path, init)
    done = _run(site, "-m", "foundry_fp8", "doctor", "--format", "json")
    report = json.loads(done.stdout)
    env = report["environment"]
    assert env["flash_attn"] == "2.7.4" and env["flash_attn_import_checked"]
    found = [(f["severity"], f["key"]) for f in report["findings"] if f["rule"] == "FP8216"]
    if severity:
        assert init.split("'")[1].split(":")[-1].strip() in env["flash_attn_import_error"]
        assert found == [(severity, "flash_attn")]
    else:
        assert env["flash_attn_import_error"] is None and found == []
    text = _run(site, "-m", "foundry_fp8", "doctor", "--no-te-import").stdout
    row = next(line for line in text.splitlines() if line.startswith("flash-attn"))
    assert row.split(None, 1)[1] == "2.7.4"  # --no-te-import: neither import is tried
    assert "FP8216" not in text


CHECK = "from llmfoundry.models.layers.attention import is_flash_v2_installed as f; print(f())"


def test_the_reference_import_llmfoundry_refuses_an_undefined_symbol(tmp_path: Path):
    refused = _run(_site(tmp_path, BROKEN), "-c", CHECK)
    assert "The flash_attn package is not installed correctly" in refused.stderr


def test_the_reference_llmfoundry_takes_another_failure_for_no_flash_attn(tmp_path: Path):
    ignored = _run(_site(tmp_path, OTHER_CUDA), "-c", CHECK)
    assert ignored.stdout.splitlines()[-1] == "False", ignored.stderr[-2000:]
