"""`fp8_state_from_checkpoint` turns whatever torch.load raises into one line naming the file
(FP8StateError), as a bad file's fault. The list of types it allows is ours, not the file's: a
failure building it (numpy < 1.25 has no `np.dtypes`) is our bug and must surface as itself,
not as "not a readable checkpoint" blaming a good checkpoint (the project's oldest numpy is
1.26, so the failure here is simulated)."""

from __future__ import annotations

import pytest
import torch

from foundry_fp8.composer import state
from foundry_fp8.composer.state import FP8StateError, fp8_state_from_checkpoint


def test_a_failure_building_the_allowed_types_is_not_blamed_on_the_file(tmp_path, monkeypatch):
    path = tmp_path / "ep0-ba10-rank0.pt"
    torch.save({"state": {"callbacks": {"FP8State": {"modules": {}}}}}, path)

    def broken() -> list:
        raise AttributeError("module 'numpy' has no attribute 'dtypes'")

    monkeypatch.setattr(state, "_composer_checkpoint_types", broken)
    with pytest.raises(AttributeError, match="dtypes") as raised:
        fp8_state_from_checkpoint(path)
    assert not isinstance(raised.value, FP8StateError)
