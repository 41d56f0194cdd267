"""fp8_stats' initial-scale marks on 2 CPU ranks (gloo), emulated delayed scaling with
`reduce_amax` on and off. With it off, a rank whose gradients were 0 so far (its batches fully
masked) still casts them at delayed scaling's initial scale 1 while the other rank does not: the
pooled row holds that cast, so it is marked `fp8_initial_scale` on every rank. Each rank marked
only its own casts, so rank 0 logged no mark and judged the row while rank 1 did not: the
tables fp8_guard votes on, and fp8_stats' trackers saved in checkpoints, differed by rank."""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
from composer.core import Event
from composer.devices import DeviceCPU
from torch import nn

from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.health import INITIAL_SCALE, layer_key
from foundry_fp8.recipe import FP8Recipe
from tests.ranks import init_rank, run_ranks

STEPS, INTERVAL, MASKED = 5, 2, 3  # rank 1's loss is 0 on its first MASKED batches
LAYERS = ("0", "2")


class _Logger:
    def __init__(self):
        self.metrics: dict[int, dict] = {}
        self.destinations = [self]

    def log_metrics(self, metrics, step):
        self.metrics.setdefault(step, {}).update(metrics)

    def log_hyperparameters(self, hparams):
        pass

    def log_images(self, *args, **kwargs):
        pass

    def log_table(self, *args, **kwargs):
        pass


def _marked(tables: dict[int, list], step: int, table: dict, flags: dict) -> None:
    """fp8_stats' listener (fp8_guard's place): the rows the table fp8_guard judges marks."""
    tables[step] = sorted(f"{layer}/{tensor}" for (layer, tensor), stats in table.items()
                          if stats.get(INITIAL_SCALE))


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    init_rank(rank, rendezvous)
    result = {}
    for reduce_amax in (True, False):
        recipe = FP8Recipe(scaling="delayed", amax_history_len=4, reduce_amax=reduce_amax)
        torch.manual_seed(0)
        model = nn.Sequential(EmulatedFP8Linear(32, 32), nn.GELU(), EmulatedFP8Linear(32, 32))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        stats = FP8Stats(interval=INTERVAL)
        state = types.SimpleNamespace(model=model, run_name="run", callbacks=[stats],
                                      algorithms=[], device=DeviceCPU(),
                                      timestamp=types.SimpleNamespace(batch=0))
        logger = _Logger()
        tables: dict[int, list] = {}
        stats.run_event(Event.FIT_START, state, logger)
        stats.listeners.append(functools.partial(_marked, tables))
        initial: dict[int, list] = {}  # by hand: this rank's gradient casts at scale 1
        gen = torch.Generator().manual_seed(rank)
        for batch in range(STEPS):
            state.timestamp.batch = batch
            metas = {name: read_fp8_meta(model[int(name)]) for name in LAYERS}
            initial[batch] = sorted(
                f"{name}/gradient" for name, meta in metas.items()
                if "bwd_scale" not in meta or (meta["bwd_scale"][0] == 1
                                               and not meta["bwd_amax_history"][:, 0].any()))
            stats.run_event(Event.BATCH_START, state, logger)
            optimizer.zero_grad()
            with fp8_autocast(recipe=recipe):
                loss = model(torch.randn(16, 32, generator=gen)).mean()
            (loss * (0.0 if rank == 1 and batch < MASKED else 1.0)).backward()
            for p in model.parameters():
                torch_dist.all_reduce(p.grad)
            optimizer.step()
            state.timestamp.batch = batch + 1
            for event in (Event.AFTER_TRAIN_BATCH, Event.BATCH_END):
                stats.run_event(event, state, logger)
        result[str(reduce_amax)] = {
            "tables": tables, "initial": initial,
            "logged": {step: sorted(f"{layer}/gradient" for layer in LAYERS
                                    if metrics.get(layer_key(INITIAL_SCALE, "gradient", layer)))
                       for step, metrics in logger.metrics.items()}}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("initial_marks")
    run_ranks(_worker, str(out), deadline_s=150)
    found = [out / f"rank{r}.json" for r in range(2)]
    assert all(p.exists() for p in found), "a rank did not finish (crashed or hung)"
    return [json.loads(p.read_text()) for p in found]


@pytest.mark.parametrize("reduce_amax", ["True", "False"])
def test_a_row_is_marked_initial_on_every_rank_where_any_rank_cast_at_scale_1(results,
                                                                              reduce_amax):
    rank0, rank1 = results[0][reduce_amax], results[1][reduce_amax]
    for step in range(0, STEPS, INTERVAL):
        # the gradient rows a rank casts at scale 1, read by hand from its emulated state
        cast_at_1 = sorted(set(rank0["initial"][str(step)]) | set(rank1["initial"][str(step)]))
        marked = [row for row in rank0["tables"][str(step)] if row.endswith("/gradient")]
        assert marked == cast_at_1, step
        assert rank1["tables"][str(step)] == rank0["tables"][str(step)], step
        assert rank0["logged"][str(step)] == cast_at_1, step
    # the scenario: with reduce_amax on, rank 1 takes rank 0's amaxes; off, it keeps scale 1
    # through its masked batches, and rank 0 does not
    masked = ["0/gradient", "2/gradient"] if reduce_amax == "False" else []
    assert rank1["initial"][str(INTERVAL)] == masked
    assert rank0["initial"][str(INTERVAL)] == []
