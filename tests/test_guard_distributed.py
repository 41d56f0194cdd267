"""fp8_guard on 2 CPU ranks (gloo): only rank 1 sees the fault, both ranks move the same layer to
high precision at the same step (and, when the fault ends, back to FP8 at the same step); a
guard failure on one rank switches it off on both."""

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
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.emulate import EmulatedFP8Linear
from foundry_fp8.fault import InjectOutlier
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.recipe import FP8Recipe
from tests.ranks import init_rank, run_ranks, train_batches

STEPS, INTERVAL, START, STOP = 12, 2, 3, 7
RECIPE = FP8Recipe(scaling="delayed", amax_history_len=4)


class _Logger:
    """Composer's Logger and its one destination: the callbacks log to each destination."""

    def __init__(self):
        self.metrics: dict[int, dict] = {}
        self.destinations = [self]

    def log_metrics(self, metrics, step):
        self.metrics.setdefault(step, {}).update(metrics)

    def log_hyperparameters(self, hparams):
        pass


def _train(rank: int, broken: bool, stop: int | None = None) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(32, 32), nn.GELU(), EmulatedFP8Linear(32, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stats = FP8Stats(interval=INTERVAL)
    guard = FP8Guard(consecutive=2, max_fallback_share=0.5,
                     repromote_after=None if stop is None else 2)
    # a mean loss: layer 0 stays healthy
    fault = InjectOutlier("2", start=START, ranks=[1], stop=stop)
    callbacks = [stats, guard, fault]
    state = types.SimpleNamespace(model=model, run_name="run", callbacks=callbacks,
                                  algorithms=[], device=DeviceCPU(),
                                  precision=types.SimpleNamespace(value="fp32"),
                                  timestamp=types.SimpleNamespace(batch=0))
    logger = _Logger()
    for callback in callbacks:
        callback.run_event(Event.FIT_START, state, logger)
    history, states = {}, {}
    patch = (mock.patch.object(guard.core, "candidates", side_effect=TypeError("injected"))
             if broken and rank == 1 else contextlib.nullcontext())
    with patch:
        for batch in train_batches(model, optimizer, callbacks, state, logger, RECIPE, STEPS,
                                   rank):
            history[batch + 1] = sorted(guard.core.fallbacks) if guard.core else []
            states[batch + 1] = read_fp8_meta(model[2])["fwd_amax_history"].tolist()
    return {"history": history, "steps": {k: f.step for k, f in guard.core.fallbacks.items()},
            "repromoted": [(r.layer, r.step, r.fallen_at) for r in guard.core.repromotions],
            "disabled": guard.disabled, "states": states, "stats_disabled": stats.disabled,
            "logged": {s: m.get("fp8/guard/fallback_layers") for s, m in logger.metrics.items()}}


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    init_rank(rank, rendezvous)
    results = {"clean": _train(rank, broken=False), "broken": _train(rank, broken=True),
               "transient": _train(rank, broken=False, stop=STOP)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("guard_ranks")
    run_ranks(_worker, str(out), deadline_s=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_both_ranks_fall_back_the_same_layer_at_the_same_step(results):
    rank0, rank1 = results[0]["clean"], results[1]["clean"]
    assert rank0["steps"] == rank1["steps"] == {"2": rank0["steps"]["2"]}
    assert rank0["history"] == rank1["history"]
    step = rank0["steps"]["2"]
    assert START < step < STEPS
    # rank 0 never saw the fault, yet its layer 2 stops casting after the fallback: its delayed
    # state stands still from the step after the decision on
    states = rank0["states"]
    assert states[str(step + 1)] == states[str(STEPS)]
    assert states[str(step + 1)] != states[str(step)]  # the deciding step itself cast in FP8
    assert {s: v for s, v in rank0["logged"].items() if v} == {
        str(s): 1.0 for s in range(step, STEPS, INTERVAL)}


def test_a_guard_failure_on_one_rank_switches_it_off_on_both(results):
    rank0, rank1 = results[0]["broken"], results[1]["broken"]
    assert rank0["disabled"] and rank1["disabled"]
    assert rank0["steps"] == rank1["steps"] == {}
    assert not rank0["stats_disabled"] and not rank1["stats_disabled"]  # fp8_stats goes on


def test_both_ranks_return_the_layer_to_fp8_at_the_same_step_with_a_fresh_state(results):
    """The fault (rank 1 only) ends at batch STOP: the pooled what-if statistics are healthy
    from the next logging step, and after 2 of them both ranks put layer 2 back in FP8; rank 0's
    delayed state restarts from zero and records one FP8 batch."""
    rank0, rank1 = results[0]["transient"], results[1]["transient"]
    assert rank0["repromoted"] == rank1["repromoted"]
    [(layer, step, fallen_at)] = rank0["repromoted"]
    first_healthy = next(s for s in range(0, STEPS, INTERVAL) if s >= STOP)
    assert layer == "2" and fallen_at < STOP and step == first_healthy + INTERVAL
    assert rank0["history"] == rank1["history"] and rank0["steps"] == {}
    states = rank0["states"]
    assert states[str(step + 1)] == [[0.0] * 3] * 4  # reset at the decision
    assert sum(any(row) for row in states[str(step + 2)]) == 1  # one FP8 batch since
