"""fp8_guard and fp8_stats on 2 CPU ranks (gloo) when our own work fails on one rank only: no
rank may leave the guard's vote at a logging step, whose all_reduce the backend would pair with
that rank's next collective (a gradient all_reduce of another size; gloo aborts the process:
`op.preamble.length <= op.nbytes. 20 vs 4`, seen in 2-rank `composer -n 2` runs of the tiny
MPT). Failing: the guard hooking an agreed layer into high precision, and fp8_stats' host-side
statistics after the pooling. Both ranks must finish, switching the failed callback off at the
same logging step."""

from __future__ import annotations

import contextlib
import json
import logging
import types
from pathlib import Path
from unittest import mock

import torch
from composer.core import Event
from composer.devices import DeviceCPU
from torch import nn

from foundry_fp8.composer import guard as guard_module
from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.emulate import EmulatedFP8Linear
from foundry_fp8.fault import InjectOutlier
from foundry_fp8.recipe import FP8Recipe
from tests.ranks import init_rank, run_ranks, train_batches

STEPS, INTERVAL, START = 12, 2, 3
RECIPE = FP8Recipe(scaling="delayed", amax_history_len=4)


class _Logger:
    def __init__(self):
        self.destinations = [self]

    def log_metrics(self, metrics, step):
        pass

    def log_hyperparameters(self, hparams):
        pass


def _worker(rank: int, rendezvous: str, out_dir: str, failing: str) -> None:
    init_rank(rank, rendezvous)
    torch.manual_seed(0)
    model = nn.Sequential(EmulatedFP8Linear(32, 32), nn.GELU(), EmulatedFP8Linear(32, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stats = FP8Stats(interval=INTERVAL)
    guard = FP8Guard(consecutive=2, max_fallback_share=0.5)
    callbacks = [stats, guard, InjectOutlier("2", start=START, ranks=[1])]
    state = types.SimpleNamespace(model=model, run_name="run", callbacks=callbacks,
                                  algorithms=[], device=DeviceCPU(),
                                  precision=types.SimpleNamespace(value="fp32"),
                                  timestamp=types.SimpleNamespace(batch=0))
    logger = _Logger()
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    guard_module.log.addHandler(handler)
    for callback in callbacks:
        callback.run_event(Event.FIT_START, state, logger)
    broken = None
    if rank == 1 and failing == "guard":  # hooking the agreed layer into high precision
        broken = mock.patch.object(guard_module, "high_precision_hooks",
                                   side_effect=RuntimeError("injected"))
    elif rank == 1:  # fp8_stats' statistics after the pooling, at the second logging step on
        calls = []
        original = stats.monitor._metrics

        def metrics(*args):
            calls.append(args)
            if len(calls) == 2:
                raise RuntimeError("injected")
            return original(*args)

        broken = mock.patch.object(stats.monitor, "_metrics", side_effect=metrics)
    disabled_at = stats_off_at = None
    with broken if broken is not None else contextlib.nullcontext():
        for batch in train_batches(model, optimizer, callbacks, state, logger, RECIPE, STEPS,
                                   rank, sync_grads=True):
            if guard.disabled and disabled_at is None:
                disabled_at = batch
            if stats.disabled and stats_off_at is None:
                stats_off_at = batch
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "disabled_at": disabled_at, "stats_off_at": stats_off_at, "fallbacks": sorted(guard.core.fallbacks),
        "stats_disabled": stats.disabled, "said": said, "weight": model[2].weight.sum().item()}))


def _run(out: Path, failing: str) -> list[dict | None]:
    run_ranks(_worker, str(out), failing, deadline_s=120)
    return [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else None
            for r in range(2)]


def test_a_failure_acting_on_one_rank_switches_the_guard_off_on_both_at_one_step(tmp_path):
    rank0, rank1 = _run(tmp_path, "guard")
    assert rank0 is not None and rank1 is not None, "a rank did not finish (crashed or hung)"
    # the decision came at a logging step after the fault began; the next vote switched it off
    decided = rank0["disabled_at"] - INTERVAL
    assert START <= decided < STEPS - INTERVAL
    assert rank0["disabled_at"] == rank1["disabled_at"]
    # rank 0 hooked the layer (its decision stands, as documented); rank 1 failed to
    assert rank0["fallbacks"] == rank1["fallbacks"] == ["2"]
    assert not rank0["stats_disabled"] and not rank1["stats_disabled"]
    assert rank0["weight"] == rank1["weight"]  # the ranks' updates stayed in step
    # rank 0's console, the one the launcher shows, names the rank whose log holds the error
    [off] = [line for line in rank0["said"] if "it is off from now on" in line]
    assert off.startswith("fp8_guard failed on rank 1 (its error is in that rank's log)")


def test_a_stats_failure_after_pooling_on_one_rank_keeps_the_ranks_in_step(tmp_path):
    rank0, rank1 = _run(tmp_path, "stats")
    assert rank0 is not None and rank1 is not None, "a rank did not finish (crashed or hung)"
    # failed at the second logging step (batch INTERVAL); off on both at the third
    assert rank0["stats_off_at"] == rank1["stats_off_at"] == 2 * INTERVAL
    assert rank0["fallbacks"] == rank1["fallbacks"]
    assert rank0["weight"] == rank1["weight"]
