"""FP8217: the doctor says when the installed TransformerEngine is a minor release newer than the
newest one foundry-fp8's TE facts were read from (te_swap's `backend: te`, fp8_state and
fp8_guard read TE internals that are no public API); patch releases of that minor, older TE,
NGC's local builds and a run's own checks stay quiet."""

from __future__ import annotations

from dataclasses import replace

import pytest

from foundry_fp8.environment import Snapshot
from foundry_fp8.lint.rules.environment import environment_findings
from foundry_fp8.te.facts import TE_NEWEST_READ, dotted

H100 = Snapshot(python="3.11.7", torch="2.7.0", torch_cuda="12.6", gpu_name="NVIDIA H100",
                capability=(9, 0), te="2.8.0", te_torch="2.8.0", te_core="2.8.0",
                te_core_package="transformer-engine-cu12", te_import_checked=True)
TE_RUN = {"precision": "amp_fp8", "algorithms": {"te_swap": {"backend": "te"}}}


def _newer(te: str, config: dict | None = None) -> list[str]:
    snapshot = replace(H100, te=te, te_torch=te, te_core=te)
    return [f.message for f in environment_findings(snapshot, config) if f.rule == "FP8217"]


@pytest.mark.parametrize("te", ["2.21.0", "2.21.0.dev0+abc1234", "3.0.0", "2.22.1+cu13"])
def test_a_later_minor_release_is_named(te):
    [message] = _newer(te)
    assert message.startswith(f"TransformerEngine {te} is newer than {dotted(TE_NEWEST_READ)}")


@pytest.mark.parametrize("te", ["2.20.2", "2.20.9", "2.19.0", "2.5.0+f05f12c", "1.12.0"])
def test_the_releases_read_and_older_are_quiet(te):
    assert _newer(te) == []


def test_a_run_is_not_told():
    """The doctor's only: `fp8_lint` passes the run's config and gets nothing from it."""
    assert _newer("2.21.0", TE_RUN) == []
