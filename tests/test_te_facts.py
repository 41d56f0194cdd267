"""TE behind one folder (issue 15.3): the version facts in `foundry_fp8.te.facts`, checked
against what TE's release tags hold, and a `te` package that imports neither TE nor torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from foundry_fp8.te.facts import (
    dotted,
    ln_mlp_grad_slot,
    parse_version,
    refuses_pickled_extra_state,
)
from foundry_fp8.te.recompute import recompute_plan

#: Whether `transformer_engine/pytorch/_extra_state.py` (the unpickling guard) exists at each
#: TE release tag (read with `git cat-file -e <tag>:...` in NVIDIA/TransformerEngine).
EXTRA_STATE_GUARD_AT_TAG = {"2.15": False, "2.16": False, "2.16.1": True, "2.17": False,
                            "2.17.1": True, "2.18": True}


@pytest.mark.parametrize(("tag", "guarded"), EXTRA_STATE_GUARD_AT_TAG.items())
def test_the_pickle_guard_releases(tag, guarded):
    assert refuses_pickled_extra_state(parse_version(tag)) == guarded
    assert refuses_pickled_extra_state((2, 20, 2))


def test_versions_parse_and_print_one_way():
    assert parse_version("2.7.0+cu126") == (2, 7, 0) and parse_version("2.0rc1") == (2, 0)
    assert parse_version("") is None and dotted(None) == "?" and dotted((8, 9)) == "8.9"
    assert [ln_mlp_grad_slot(v) for v in (None, (2, 3, 9), (2, 4), (2, 20, 2))] == [None, 0, 2, 2]


def test_the_recompute_policy():
    ac = {"activation_checkpointing": True}
    assert recompute_plan("amp_fp8", ac, 1, (2, 8), emulated=False).settings == {
        "te_checkpoint_wrapper": True, "activation_checkpointing_reentrant": False}
    assert "1.11" in recompute_plan("amp_fp8", ac, 1, (1, 11), emulated=False).refusal
    assert "only FSDP1" in recompute_plan("amp_fp8", ac, 2, (2, 8), emulated=False).refusal
    assert recompute_plan("amp_bf16", ac, 1, (2, 8), emulated=False).refusal is None


def test_importing_the_te_folder_imports_neither_te_nor_torch():
    code = ("import sys; import foundry_fp8.te, foundry_fp8.te.facts, foundry_fp8.te.probe, "
            "foundry_fp8.te.recompute; "
            "print(sorted(m for m in ('torch', 'transformer_engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_without_te_the_runtime_says_how_to_install_te_itself(monkeypatch):
    """te_swap's `backend: te` and fp8_stats' `te_debug` without TE name pip's command for TE
    (foundry-fp8 is not on PyPI, so `pip install 'foundry-fp8[te]'` found nothing), with the
    bound of setup.cfg's `te` extra (checked against it in tests/test_lint_install_hint.py)."""
    from foundry_fp8.te import backend, debug, probe
    from foundry_fp8.te.facts import TE_INSTALL_HINT

    monkeypatch.setattr(probe, "te_available", lambda: False)
    monkeypatch.setattr(debug, "te_available", lambda: False)
    with pytest.raises(RuntimeError) as refused:
        backend.require_te()
    messages = [str(refused.value), debug.te_debug_problem() or ""]
    for message in messages:
        assert TE_INSTALL_HINT in message and "foundry-fp8[" not in message
    assert "nvdlfw-inspect" in messages[1].split(TE_INSTALL_HINT, 1)[1]
