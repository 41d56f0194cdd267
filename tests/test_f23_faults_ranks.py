"""A bug of ours on one rank of two (gloo) never leaves the other waiting in a collective alone:
fp8_guard's start, its judging and its acting fail on rank 1 only; without `strict` both ranks
switch the guard off and train on, with `strict: true` both ranks raise at the same batch (a
rank that raised alone left its partner in the next all_reduce: the classic hang). fp8_state's
save reading its state fails on rank 1 only: both ranks still meet in its all_gather and save
the same 'unsaved' entry."""

from __future__ import annotations

import contextlib
import json
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
from composer.core import Event
from composer.devices import DeviceCPU
from torch import nn

from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.state import FP8State
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.fault import InjectOutlier
from foundry_fp8.recipe import FP8Recipe
from tests.ranks import init_rank, run_ranks, train_batches

STEPS, INTERVAL, START = 8, 2, 1
RECIPE = FP8Recipe(scaling="delayed", amax_history_len=4)
#: where each fault is injected on rank 1: the guard's start, its judging (every logging step)
#: and its acting (the fallback the outlier in layer 2 brings at step 4)
FAULTS = {"start": "_start", "judge": "candidates", "act": "_apply"}


class _Logger:
    destinations: list = []


def _scenario(rank: int, fault: str, strict: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(32, 32), nn.GELU(), EmulatedFP8Linear(32, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stats = FP8Stats(interval=INTERVAL)
    guard = FP8Guard(consecutive=2, max_fallback_share=0.5, strict=strict)
    callbacks = [stats, guard, InjectOutlier("2", start=START)]
    state = types.SimpleNamespace(model=model, run_name="run", callbacks=callbacks,
                                  algorithms=[], device=DeviceCPU(),
                                  precision=types.SimpleNamespace(value="fp32"),
                                  timestamp=types.SimpleNamespace(batch=0))
    logger = _Logger()
    bug = RuntimeError(f"injected bug in {FAULTS[fault]}")

    def broken(owner: object, fault_here: str) -> contextlib.AbstractContextManager:
        return (mock.patch.object(owner, FAULTS[fault], side_effect=bug)
                if rank == 1 and fault == fault_here else contextlib.nullcontext())

    batch, raised = -1, None
    try:
        with broken(guard, "start"):
            for callback in callbacks:
                callback.run_event(Event.FIT_START, state, logger)
        with broken(guard.core, "judge"), broken(guard, "act"):
            for done in train_batches(model, optimizer, callbacks, state, logger, RECIPE,
                                      STEPS, rank):
                batch = done
    except RuntimeError as error:
        raised = str(error)
    return {"raised": raised, "batch": batch, "disabled": guard.disabled}


def _save_scenario(rank: int) -> dict:
    """fp8_state's save, its state unreadable on rank 1 only."""
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(32, 32))
    callback = FP8State()
    callback._model = model
    with torch.no_grad(), fp8_autocast(recipe=RECIPE):
        model(torch.randn(16, 32))
    with (mock.patch.object(callback, "_local_state", side_effect=KeyError("injected"))
          if rank == 1 else contextlib.nullcontext()):
        saved = callback.state_dict()
    return {"unsaved": bool(saved.get("unsaved")), "modules": sorted(saved["modules"])}


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    init_rank(rank, rendezvous)
    results = {f"{fault}-{'strict' if strict else 'lax'}": _scenario(rank, fault, strict)
               for fault in FAULTS for strict in (False, True)}
    results["save"] = _save_scenario(rank)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fault_ranks")
    run_ranks(_worker, str(out), deadline_s=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_without_strict_both_ranks_switch_the_guard_off_and_train_on(results, fault):
    rank0, rank1 = (r[f"{fault}-lax"] for r in results)
    assert rank0 == rank1 == {"raised": None, "batch": STEPS - 1, "disabled": True}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_with_strict_both_ranks_raise_at_the_same_batch(results, fault):
    rank0, rank1 = (r[f"{fault}-strict"] for r in results)
    assert rank1["raised"] == f"injected bug in {FAULTS[fault]}"
    assert any(where in (rank0["raised"] or "") for where in ("on another rank", "on rank 1"))
    assert rank0["batch"] == rank1["batch"] < STEPS - 1


def test_a_save_that_cannot_read_the_state_on_one_rank_saves_none_on_both(results):
    assert results[0]["save"] == results[1]["save"] == {"unsaved": True, "modules": []}
