"""Doctor/lint on a broken TE (FP8201/FP8206) and Composer's torch check: a TE whose
import raises breaks every LLM-Foundry run, and Composer's torch check orders pre-releases as
packaging does."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
from packaging import version

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.known import UNSHARD_WITH_SYNC_TORCH, auto_microbatch_fsdp_fails
from foundry_fp8.lint.rules.environment import environment_findings
from foundry_fp8.te.facts import dotted

LAPTOP_WITH_TE = Snapshot(python="3.11.7", torch="2.7.0", torch_cuda="12.6", te="2.8.0",
                          te_torch="2.8.0", te_core="2.8.0",
                          te_core_package="transformer-engine-cu12", te_import_checked=True)


@pytest.mark.parametrize("torch", ["2.6.0a0+df5bbc09d1", "2.6.0", "2.7.0a0+79aa17489c.nv25.04",
                                   "2.7.1rc1", "2.7.1a0+abc", "2.7.1", "2.7.1.post1",
                                   "2.8.0.dev20250601", "2.11.0+cu130", "2.7.0.post2"])
def test_auto_microbatch_judges_torch_as_composer_s_own_check(torch):
    """composer/trainer/_patch_pytorch.py:41 compares `version.parse(torch.__version__)` with
    packaging: NGC's 2.6.0a0 is below 2.6.0 (NameError), 2.7.1rc1 below 2.7.1 (none)."""
    low, high = (version.parse(dotted(v)) for v in UNSHARD_WITH_SYNC_TORCH)
    assert auto_microbatch_fsdp_fails("0.32.1", torch) is not (
        low <= version.parse(torch) < high)


def _fake_te(tmp_path, body: str) -> str:
    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text(body)
    return str(tmp_path)


@pytest.mark.parametrize(("body", "breaks"), [
    ("raise ImportError('transformer_engine_torch.so: undefined symbol: _ZN3c10')", True),
    ("raise ModuleNotFoundError(\"No module named 'transformer_engine_torch'\", "
     "name='transformer_engine_torch')", False),
])
def test_a_te_import_that_raises_stops_llmfoundry_s_import(tmp_path, body, breaks):
    """The fact FP8206 now states, read at the sink: LLM-Foundry's own import with such a TE
    (hf_checkpointer.py catches ModuleNotFoundError only)."""
    env = {**os.environ, "PYTHONPATH": _fake_te(tmp_path, body)}
    done = subprocess.run([sys.executable, "-c", "import llmfoundry"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert (done.returncode != 0) is breaks, done.stderr[-500:]


def test_a_broken_te_is_said_to_stop_every_run_and_no_gpu_does_not_promise_emulation():
    broken = replace(LAPTOP_WITH_TE, te_import_error="ImportError: /x/transformer_engine_torch"
                     ".so: undefined symbol: _ZN3c10", te_import_raised="ImportError")
    found = {f.rule: f for f in environment_findings(broken)}
    assert "emulated backend works here once TransformerEngine imports" in found["FP8201"].message
    assert "`import llmfoundry` raises it too" in found["FP8206"].message
    fix = found["FP8206"].fix
    assert "--force-reinstall --no-deps --no-cache-dir --no-build-isolation " \
        '"transformer-engine-torch==2.8.0"' in fix
    assert "pip uninstall -y transformer-engine transformer-engine-torch " \
        "transformer-engine-cu12" in fix
    gone = replace(LAPTOP_WITH_TE, te_import_error="ModuleNotFoundError: No module named "
                   "'transformer_engine_torch'", te_import_raised="ModuleNotFoundError")
    found = {f.rule: f for f in environment_findings(gone)}
    assert "once TransformerEngine" not in found["FP8201"].message
    assert "llmfoundry" not in found["FP8206"].message
