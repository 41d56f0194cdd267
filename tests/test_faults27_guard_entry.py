"""A checkpoint whose fp8_guard entry cannot be read (edited by hand, cut, or saved by another
version of foundry-fp8 with other fields): before, the guard logged a traceback and switched
itself off for the whole resumed run, so a layer in FP8 trouble later was never moved (and with
undecodable JSON every later checkpoint's save failed too). Now it is one line naming the
checkpoint, the guard starts without decisions and guards on; `strict: true` stops the run with
that line."""

from __future__ import annotations

import logging

import pytest
import torch

from foundry_fp8.guard import GuardStateError
from tests.test_faults27_guard_exclude import FIRST, _trainer
from tests.test_guard_flops import FAULTY

BAD = {"cut": '{"fallbacks": [', "fields": '{"fallbacks": [{"layer": "x"}]}'}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("first")
    trainer, guard = _trainer(folder, FIRST)
    trainer.fit()
    trainer.close()
    assert list(guard.core.fallbacks) == [FAULTY]
    return folder / "checkpoints" / f"ep0-ba{FIRST}-rank0.pt"


def _with_entry(checkpoint, folder, decisions: str):
    saved = torch.load(checkpoint, weights_only=False)
    saved["state"]["callbacks"]["FP8Guard"]["decisions"] = decisions
    folder.mkdir()
    torch.save(saved, folder / "bad.pt")
    return str(folder / "bad.pt")


@pytest.mark.parametrize("bad", sorted(BAD))
def test_an_unreadable_guard_entry_is_one_line_and_the_guard_guards_on(checkpoint, tmp_path,
                                                                     caplog, bad):
    load = _with_entry(checkpoint, tmp_path / "bad", BAD[bad])
    trainer, guard = _trainer(tmp_path / "resumed", FIRST + 4, load=load)
    with caplog.at_level(logging.WARNING, logger="foundry_fp8"):
        trainer.fit()
        trainer.save_checkpoint(str(tmp_path / "after.pt"))
    trainer.close()
    said = [r for r in caplog.records if r.name == "foundry_fp8.composer.guard"]
    assert not [r for r in said if r.exc_info or "failed" in r.getMessage()]
    [unreadable] = [r.getMessage() for r in said if "not readable" in r.getMessage()]
    assert unreadable.startswith(f"fp8_guard: {load}: its fp8_guard state is not readable (")
    assert "\n" not in unreadable and "starts with every layer in FP8" in unreadable
    # judged afresh from the resume: the faulty layer falls back again at the second judged
    # step, and the next checkpoint holds that decision
    assert not guard.disabled and guard.core.fallbacks[FAULTY].step == FIRST + 2
    assert FAULTY in torch.load(tmp_path / "after.pt", weights_only=False)[
        "state"]["callbacks"]["FP8Guard"]["decisions"]


def test_under_strict_an_unreadable_guard_entry_stops_the_run_with_that_line(checkpoint,
                                                                             tmp_path):
    load = _with_entry(checkpoint, tmp_path / "bad", BAD["cut"])
    trainer, _ = _trainer(tmp_path / "resumed", FIRST + 4, load=load, strict=True)
    with pytest.raises(GuardStateError) as raised:
        trainer.fit()
    trainer.close()
    assert str(raised.value) == (f"fp8_guard: {load}: its fp8_guard state is not readable "
                                 "(JSONDecodeError: Expecting value: line 1 column 16 (char 15));"
                                 " strict: true stops the run")
