"""fp8_stats' initial-scale marks on 2 CPU ranks (gloo), emulated delayed scaling with
`reduce_amax` on and off. With it off a rank can cast at delayed scaling's initial scale 1 while
the other does not: its gradients were 0 so far (its batches fully masked: zeros, which move no
statistic, so the row is judged on rank 0's casts), or it skipped a layer so far (an expert
without tokens: its first nonzero cast at scale 1 is in the pooled row, so the row is marked
`fp8_initial_scale`). Each rank marked only its own casts: the tables fp8_guard votes on, and
fp8_stats' trackers saved in checkpoints, differed by rank, and rank 0 logged no mark for a row
holding rank 1's scale-1 cast."""

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
from tests.ranks import StepLogger, init_rank, run_ranks

STEPS, INTERVAL = 5, 2
#: rank 1's first batches masked (its gradients 0 at logging step 2 yet) or skipping layer 2
#: (its first forward at logging step 2)
HELD_BACK = {"masked": 3, "skipped": 2}
LAYERS = ("0", "2")
#: (meta key prefix, slot): the emulated state each watched tensor is cast with
SLOTS = {"activation": ("fwd", 0), "weight": ("fwd", 1), "gradient": ("bwd", 0)}
#: skipping a layer on one rank needs `reduce_amax: false`: with it, TE (and the emulation)
#: all-reduce the amaxes of the layers each rank ran, of other sizes then
CASES = [(True, "masked"), (False, "masked"), (False, "skipped")]


def _marked(tables: dict[int, list], step: int, table: dict, flags: dict) -> None:
    """fp8_stats' listener (fp8_guard's place): the rows the table fp8_guard judges marks."""
    tables[step] = sorted(f"{layer}/{tensor}" for (layer, tensor), stats in table.items()
                          if stats.get(INITIAL_SCALE))


def _at_initial_scale(model: nn.Module) -> list[str]:
    """The watched tensors this rank's next cast takes at scale 1, read by hand from the
    emulated state: no state yet, or scale 1 with nothing recorded."""
    rows = []
    for name in LAYERS:
        meta = read_fp8_meta(model[int(name)])
        for tensor, (key, slot) in SLOTS.items():
            if f"{key}_scale" not in meta or (meta[f"{key}_scale"][slot] == 1 and
                                              not meta[f"{key}_amax_history"][:, slot].any()):
                rows.append(f"{name}/{tensor}")
    return rows


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    init_rank(rank, rendezvous)
    result = {}
    for reduce_amax, mode in CASES:
        recipe = FP8Recipe(scaling="delayed", amax_history_len=4, reduce_amax=reduce_amax)
        torch.manual_seed(0)
        model = nn.Sequential(EmulatedFP8Linear(32, 32), nn.GELU(), EmulatedFP8Linear(32, 32))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        stats = FP8Stats(interval=INTERVAL)
        state = types.SimpleNamespace(model=model, run_name="run", callbacks=[stats],
                                      algorithms=[], device=DeviceCPU(),
                                      timestamp=types.SimpleNamespace(batch=0))
        logger = StepLogger()
        tables: dict[int, list] = {}
        stats.run_event(Event.FIT_START, state, logger)
        stats.listeners.append(functools.partial(_marked, tables))
        initial: dict[int, list] = {}  # by hand: this rank's casts at scale 1
        nonzero: dict[int, list] = {}  # the rows this rank casts nonzero values of
        gen = torch.Generator().manual_seed(rank)
        for batch in range(STEPS):
            state.timestamp.batch = batch
            initial[batch] = _at_initial_scale(model)
            held_back = rank == 1 and batch < HELD_BACK[mode]
            used = LAYERS[:1] if held_back and mode == "skipped" else LAYERS
            nonzero[batch] = [f"{name}/{tensor}" for name in used for tensor in SLOTS
                              if not (held_back and mode == "masked" and tensor == "gradient")]
            stats.run_event(Event.BATCH_START, state, logger)
            optimizer.zero_grad()
            held_back = rank == 1 and batch < HELD_BACK[mode]
            with fp8_autocast(recipe=recipe):
                x = torch.randn(16, 32, generator=gen)
                loss = (model[:2] if held_back and mode == "skipped" else model)(x).mean()
            (loss * (0.0 if held_back and mode == "masked" else 1.0)).backward()
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                torch_dist.all_reduce(p.grad)
            optimizer.step()
            state.timestamp.batch = batch + 1
            for event in (Event.AFTER_TRAIN_BATCH, Event.BATCH_END):
                stats.run_event(event, state, logger)
        result[f"{reduce_amax}-{mode}"] = {
            "tables": tables, "initial": initial, "nonzero": nonzero,
            "logged": {step: sorted(f"{layer}/{tensor}" for layer in LAYERS for tensor in SLOTS
                                    if metrics.get(layer_key(INITIAL_SCALE, tensor, layer)))
                       for step, metrics in logger.metrics.items()}}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("initial_marks")
    run_ranks(_worker, str(out), deadline_s=150)
    found = [out / f"rank{r}.json" for r in range(2)]
    assert all(p.exists() for p in found), "a rank did not finish (crashed or hung)"
    return [json.loads(p.read_text()) for p in found]


@pytest.mark.parametrize(("reduce_amax", "mode"), [(str(r), m) for r, m in CASES])
def test_every_rank_marks_a_row_where_a_rank_cast_nonzero_values_at_scale_1(results,
                                                                            reduce_amax, mode):
    rank0, rank1 = (r[f"{reduce_amax}-{mode}"] for r in results)
    for step in map(str, range(0, STEPS, INTERVAL)):
        # by hand: a rank's nonzero values cast at scale 1, or only zeros anywhere and a cast
        # at scale 1 (the run's first step)
        rows = {f"{name}/{tensor}" for name in LAYERS for tensor in SLOTS}
        expected = sorted(row for row in rows if any(
            row in r["initial"][step] and row in r["nonzero"][step] for r in (rank0, rank1)) or (
            not any(row in r["nonzero"][step] for r in (rank0, rank1))
            and any(row in r["initial"][step] for r in (rank0, rank1))))
        assert rank0["tables"][step] == expected, step
        assert rank1["tables"][step] == rank0["tables"][step], step
        assert rank0["logged"][step] == expected, step
    # the scenario: with reduce_amax on, rank 1 takes rank 0's amaxes; off, it keeps scale 1
    # for what it held back, and rank 0 does not
    held = {"masked": ["0/gradient", "2/gradient"],
            "skipped": ["2/activation", "2/weight", "2/gradient"]}[mode]
    assert rank1["initial"][str(INTERVAL)] == (held if reduce_amax == "False" else [])
    assert rank0["initial"][str(INTERVAL)] == []
    marked = rank0["tables"][str(INTERVAL)]
    assert marked == (["2/activation", "2/gradient", "2/weight"]
                      if reduce_amax == "False" and mode == "skipped" else [])
