"""A TE whose import ends the interpreter without raising (a SIGSEGV or SIGILL from a TE built
for another torch or CPU, an os._exit) kills `import llmfoundry` the same way, so no run starts:
FP8206 says so and names how, and FP8201 no longer says the emulated backend works here
(before: `te_import_raised` was None, read as the probe failing). Read from the real probe on
a stand-in TE, and at the sink: LLM-Foundry's own import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest

from foundry_fp8 import environment
from foundry_fp8.environment import Snapshot, gather_snapshot
from foundry_fp8.lint.rules.environment import breaks_every_run, environment_findings

LAPTOP_WITH_TE = Snapshot(python="3.11.7", torch="2.7.0", te="2.8.0", te_torch="2.8.0",
                          te_import_checked=True)
NO_RUN = "so no training starts here"
#: A TE built against another torch: a C++ library writes a line, then the process dies.
SEGFAULT = ("import os, signal, sys\nsys.stderr.write('transformer_engine_torch: bad "
            "alloc\\n')\nsys.stderr.flush()\nos.kill(os.getpid(), signal.SIGSEGV)\n")


def _fake_te(tmp_path, body: str) -> str:
    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text(body)
    info = tmp_path / "transformer_engine-2.8.0.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: transformer-engine\n"
                                         "Version: 2.8.0\n")
    return str(tmp_path)


def _messages(snapshot: Snapshot) -> dict[str, str]:
    return {f.rule: f.message for f in environment_findings(snapshot)}


@pytest.mark.parametrize(("body", "died", "error"), [
    (SEGFAULT, "was killed by signal SIGSEGV", "Python was killed by signal SIGSEGV during the "
     "import: transformer_engine_torch: bad alloc"),
    ("import os\nos._exit(0)\n", "exited with status 0",
     "Python exited with status 0 during the import"),
    # imports, then crashes at the interpreter's exit: the import itself worked
    ("import atexit, os, signal\natexit.register(os.kill, os.getpid(), signal.SIGSEGV)\n", None,
     "Python was killed by signal SIGSEGV after the import finished"),
])
def test_the_real_probe_tells_an_import_that_ended_the_interpreter(tmp_path, monkeypatch, body,
                                                                    died, error):
    monkeypatch.setenv("PYTHONPATH", _fake_te(tmp_path, body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(environment, "TE_IMPORT_TIMEOUT_S", 120)
    snapshot = gather_snapshot(probe_te_import=True, probe_gpu=False)
    assert (snapshot.te_import_error, snapshot.te_import_raised, snapshot.te_import_died) == (
        error, None, died)
    found = _messages(snapshot)
    assert (f"`import llmfoundry` imports it too and dies the same way (Python {died}), "
            f"{NO_RUN}" in found["FP8206"]) is (died is not None)
    assert ("once TransformerEngine imports" in found["FP8201"]) is (died is not None)


@pytest.mark.parametrize("died", ["was killed by signal SIGILL", "was killed by signal SIGABRT",
                                  "failed with exit status 134"])
def test_an_import_that_died_breaks_every_run(died):
    snapshot = replace(LAPTOP_WITH_TE, te_import_error=f"Python {died} during the import",
                       te_import_died=died)
    assert breaks_every_run(snapshot)
    found = _messages(snapshot)
    assert f"dies the same way (Python {died}), {NO_RUN}" in found["FP8206"]
    assert "the emulated backend works here once TransformerEngine imports or is uninstalled" \
        in found["FP8201"]
    assert not breaks_every_run(replace(snapshot, te_import_checked=False))


def test_llmfoundry_s_own_import_dies_of_a_te_import_s_segfault(tmp_path):
    """The fact FP8206 states, at the sink: no except clause in LLM-Foundry catches a signal."""
    env = {**os.environ, "PYTHONPATH": _fake_te(tmp_path, SEGFAULT)}
    done = subprocess.run([sys.executable, "-c", "import llmfoundry"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGSEGV, done.stderr[-500:]
