"""FP8206/FP8201 say a broken TE stops every LLM-Foundry run only when its import raised an
exception `import llmfoundry` does not catch (helper F1, s22), never when the doctor's own
probe failed (its time or output limit, Python not starting): the snapshot records the class
the import raised (`te_import_raised`), read from the real probe on a stand-in TE."""

from __future__ import annotations

from dataclasses import replace

import pytest

from foundry_fp8 import environment
from foundry_fp8.environment import Snapshot, gather_snapshot
from foundry_fp8.lint.rules.environment import environment_findings

EVERY = "`import llmfoundry` raises it too"
LAPTOP_WITH_TE = Snapshot(python="3.11.7", torch="2.7.0", te="2.8.0", te_torch="2.8.0",
                          te_import_checked=True)


def _messages(snapshot: Snapshot) -> dict[str, str]:
    return {f.rule: f.message for f in environment_findings(snapshot)}


@pytest.mark.parametrize("error", [
    "did not finish within 60 s (the doctor's limit), so it was stopped",
    "printed more than 1 MiB of output (the doctor's limit), so it was stopped",
    "could not start Python: [Errno 2] No such file or directory: '/venv/bin/python'",
])
def test_the_probe_failing_is_not_said_to_stop_every_run(error):
    """Before: each was read as an exception other than ModuleNotFoundError."""
    found = _messages(replace(LAPTOP_WITH_TE, te_import_error=error))
    assert error in found["FP8206"] and EVERY not in found["FP8206"]
    assert "once TransformerEngine imports" not in found["FP8201"]


@pytest.mark.parametrize(("body", "raised"), [
    ("raise ImportError('transformer_engine_torch.so: undefined symbol: _ZN3c10')",
     "ImportError"),
    ("raise ModuleNotFoundError(\"No module named 'transformer_engine_torch'\")",
     "ModuleNotFoundError"),
    ("import time\ntime.sleep(60)", None),
])
def test_the_snapshot_records_what_the_real_probe_saw_raised(tmp_path, monkeypatch, body,
                                                              raised):
    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text(body + "\n")
    info = tmp_path / "transformer_engine-2.8.0.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: transformer-engine\n"
                                         "Version: 2.8.0\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    # the hang's probe is cut at 3 s; the others get time for the probe's Python and its
    # imports on a loaded machine (3 s made them time out there: raised None)
    monkeypatch.setattr(environment, "TE_IMPORT_TIMEOUT_S", 3 if raised is None else 120)
    snapshot = gather_snapshot(probe_te_import=True, probe_gpu=False)
    assert snapshot.te_import_checked and snapshot.te_import_error
    assert snapshot.te_import_raised == raised
    if raised is None:
        assert snapshot.te_import_error.startswith("did not finish within 3 s")
    found = _messages(snapshot)
    assert (EVERY in found["FP8206"]) is (raised == "ImportError")
