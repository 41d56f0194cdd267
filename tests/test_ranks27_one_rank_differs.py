"""fp8_stats and fp8_guard on 2 CPU ranks (gloo) where one rank differs from the other: a NaN/Inf
in rank 1's activations or gradients at one step, rank 1's inputs all zero (its amax 0), each rank
its own what-if scale (`reduce_amax: false`), rank 0 with two micro-batches a batch where rank 1
has one, and a bug of ours on rank 1 alone (at a micro-batch's start; in the guard before its
vote). What rank 0 logs is checked against a float64 reference from each rank's own tensors
(captured by this test's hooks), the ranks' tables and guard decisions against each other."""

from __future__ import annotations

import contextlib
import json
import math
import types
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as torch_dist
from composer.core import Event
from composer.devices import DeviceCPU
from torch import nn

from foundry_fp8 import emulate
from foundry_fp8.composer.guard import FP8Guard
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.emulate import EmulatedFP8Linear, fp8_autocast
from foundry_fp8.fp8_meta import read_fp8_meta
from foundry_fp8.health import layer_key
from foundry_fp8.numerics import (
    STAT_KEYS,
    finalize_stats,
    pool_sufficient_stats,
    sufficient_stats,
)
from foundry_fp8.recipe import FP8Recipe
from tests.ranks import StepLogger, init_rank, run_ranks
from tests.test_numerics import f32, ref_round_trip

FORMAT = {"activation": "e4m3", "gradient": "e5m2"}  # HYBRID, the recipes' default
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
WATCHED = ("0", "2")  # the model's two linear layers

# name: the layers' kinds, the model's delayed recipe, fp8_stats' options, batches, the function
# that raises on rank 1 (a bug of ours)
SCENARIOS: dict[str, dict[str, Any]] = {
    # the FP8 layer first: rank 1's NaN/Inf input at step 2 reaches its cast; a NaN in rank 1's
    # output gradient at step 4
    "nonfinite": {"layers": ("fp8", "plain"), "stats": {"interval": 2}, "steps": 5},
    # rank 1's inputs all zero: its activations too (no bias), its gradients not
    "zeros": {"layers": ("plain", "fp8"), "stats": {"interval": 2}, "steps": 3},
    # ... and each rank its own delayed scale: rank 1's stays 1
    "zeros_local": {"layers": ("plain", "fp8"), "stats": {"interval": 2}, "steps": 3,
                    "recipe": FP8Recipe(scaling="delayed", amax_history_len=4,
                                        reduce_amax=False)},
    # each rank its own delayed what-if scale; rank 1's tensors 16 times rank 0's
    "whatif_local": {"layers": ("plain", "plain"), "steps": 4,
                     "stats": {"interval": 3, "recipe": {"scaling": "delayed", "amax_history_len": 2,
                                                         "reduce_amax": False}}},
    # rank 0 two micro-batches a batch, rank 1 one (a NaN in rank 0's second at step 3); the
    # what-if's amaxes reduced across ranks, once a batch
    "microbatches": {"layers": ("plain", "plain"), "steps": 4,
                     "stats": {"interval": 3, "recipe": {"scaling": "delayed",
                                                         "amax_history_len": 2}}},
    "bug_microbatch": {"layers": ("fp8", "plain"), "stats": {"interval": 2}, "steps": 4,
                       "bug": "foundry_fp8.monitor.FP8Monitor.next_microbatch"},
    "bug_listen": {"layers": ("fp8", "plain"), "stats": {"interval": 2}, "steps": 4,
                   "bug": "foundry_fp8.composer.guard.short_layer"},
}
RECIPE = FP8Recipe(scaling="delayed", amax_history_len=4)


def _inputs(rank: int, step: int, micro: int, scenario: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x = torch.randn(8, 16, generator=gen) * (1 + 15 * rank) * (1 + step)
    if scenario == "nonfinite" and rank == 1 and step == 2:
        x[0, 0], x[1, 1] = float("nan"), float("inf")
    if scenario.startswith("zeros") and rank == 1:
        x.zero_()
    if scenario == "microbatches" and rank == 0 and step == 3 and micro == 1:
        x[2, 5] = float("nan")
    return x


def _loss_weight(rank: int, step: int, scenario: str) -> torch.Tensor:
    w = torch.ones(8, 16)
    if scenario == "nonfinite" and rank == 1 and step == 4:
        w[2, 3] = float("nan")  # one NaN in rank 1's output gradient of layer 2
    return w


def _capture(model: nn.Sequential, seen: dict) -> None:
    """Every input and output gradient of the watched layers, per step and micro-batch."""
    for name in WATCHED:
        module = model[int(name)]

        def forward(mod, args, name=name):
            seen.setdefault((seen["step"], "activation", name), []).append(
                args[0].detach().reshape(-1).tolist())

        def backward(mod, grad_output, name=name):
            seen.setdefault((seen["step"], "gradient", name), []).append(
                grad_output[0].detach().reshape(-1).tolist())

        module.register_forward_pre_hook(forward)
        module.register_full_backward_pre_hook(backward)


def _scenario(rank: int, name: str) -> dict:
    spec = SCENARIOS[name]
    torch.manual_seed(0)
    make = {"fp8": EmulatedFP8Linear, "plain": nn.Linear}
    model = nn.Sequential(make[spec["layers"][0]](16, 16, bias=False), nn.GELU(),
                          make[spec["layers"][1]](16, 16, bias=False))
    stats = FP8Stats(**spec["stats"])
    guard = FP8Guard(consecutive=1, max_fallback_share=1.0)
    callbacks = [stats, guard]
    state = types.SimpleNamespace(model=model, run_name="run", callbacks=callbacks,
                                  algorithms=[], device=DeviceCPU(),
                                  precision=types.SimpleNamespace(value="fp32"),
                                  timestamp=types.SimpleNamespace(batch=0))
    logger = StepLogger()
    seen: dict = {"step": 0}
    _capture(model, seen)
    tables: dict[int, dict] = {}
    stats.listeners.append(lambda step, table, flags: tables.__setitem__(step, {
        f"{layer}|{tensor}": values for (layer, tensor), values in table.items()}))
    bug = spec.get("bug")
    broken = (mock.patch(bug, side_effect=RuntimeError("injected bug on rank 1"))
              if bug and rank == 1 else contextlib.nullcontext())

    def events(*names: Event) -> None:
        for event in names:
            for callback in callbacks:
                callback.run_event(event, state, logger)

    events(Event.FIT_START)
    micro = 2 if name == "microbatches" and rank == 0 else 1
    scales, fallbacks, done = {}, {}, -1
    with broken:
        for batch in range(spec["steps"]):  # no optimizer step: a NaN stays in its own step
            seen["step"] = state.timestamp.batch = batch
            events(Event.BATCH_START, Event.BEFORE_TRAIN_BATCH)
            # each FP8 layer's scales as it casts with them in this batch
            scales[batch] = {i: read_fp8_meta(model[i]) for i in (0, 2)
                             if isinstance(model[i], EmulatedFP8Linear)}
            for m in range(micro):
                events(Event.BEFORE_FORWARD)
                # plain layers only: no autocast, whose amax reduction at each exit (TE's
                # too) pairs micro-batches across ranks
                with (fp8_autocast(recipe=spec.get("recipe", RECIPE)) if "fp8" in spec["layers"]
                      else contextlib.nullcontext()):
                    out = model(_inputs(rank, batch, m, name))
                (out * _loss_weight(rank, batch, name)).sum().backward()
            events(Event.AFTER_TRAIN_BATCH)
            state.timestamp.batch = batch + 1
            events(Event.BATCH_END, Event.BATCH_CHECKPOINT)
            fallbacks[batch] = sorted(guard.core.fallbacks)
            done = batch
    events(Event.FIT_END)
    return {"metrics": logger.metrics, "tables": tables, "done": done,
            "seen": [[*key, pieces] for key, pieces in seen.items() if key != "step"],
            "scales": {b: {i: {k: v.tolist() for k, v in meta.items()} for i, meta in s.items()}
                       for b, s in scales.items()},
            "fallbacks": fallbacks, "stats_disabled": stats.disabled,
            "guard_disabled": guard.disabled}


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    init_rank(rank, rendezvous)
    try:
        for name in SCENARIOS:
            Path(out_dir, f"{name}-rank{rank}.json").write_text(json.dumps(_scenario(rank, name)))
            torch_dist.barrier()
    finally:
        torch_dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every scenario in one 2-process run."""
    out = tmp_path_factory.mktemp("one_rank_differs")
    run_ranks(_worker, str(out), deadline_s=240)

    def load(name: str) -> list[dict]:
        paths = [out / f"{name}-rank{r}.json" for r in range(2)]
        missing = [p.name for p in paths if not p.exists()]
        assert not missing, f"{name}: no result from {missing}: a rank hung or died"
        return [json.loads(p.read_text()) for p in paths]

    return load


def _pieces(ranks: list[dict], step: int, tensor: str, layer: str) -> list[list[float]]:
    """Each rank's tensors of that layer at that step, one list per micro-batch."""
    return [values for r in ranks for s, t, lay, pieces in r["seen"]
            if (s, t, lay) == (step, tensor, layer) for values in pieces]


def _te_scale(values: list[float], fmt: str) -> float:
    """Current scaling's scale as TE computes it: `fp8_max / amax` in float32, 1 for an amax
    that is 0, Inf or NaN (common/recipe/recipe_common.cuh:24-26); NaN elements are skipped by
    the amax's fmaxf, an Inf is kept."""
    amax = max((abs(v) for v in values if not math.isnan(v)), default=0.0)
    return 1.0 if amax == 0 or math.isinf(amax) else f32(FP8_MAX[fmt] / f32(amax))


def _reference(pieces: list[tuple[list[float], float]], fmt: str) -> dict[str, float]:
    """Float64 statistics of pieces each cast with its own scale, pooled."""
    finite = [(v, s) for values, s in pieces for v in values if math.isfinite(v)]
    rt = [ref_round_trip(v, fmt, s) for v, s in finite]
    return {"amax": max(abs(v) for v, _ in finite),
            "nan_count": sum(math.isnan(v) for values, _ in pieces for v in values),
            "inf_count": sum(math.isinf(v) for values, _ in pieces for v in values),
            "underflow_pct": 100.0 * sum(1 for (v, _), r in zip(finite, rt, strict=True)
                                         if v and not r) / len(finite),
            "overflow_pct": 100.0 * sum(1 for (v, s), r in zip(finite, rt, strict=True)
                                        if abs(v) * s > FP8_MAX[fmt]) / len(finite),
            "mse": sum((v - r) ** 2 for (v, _), r in zip(finite, rt, strict=True)) / len(finite),
            # the smallest scale of a piece with something to scale
            "scale": min(s for values, s in pieces if any(v and math.isfinite(v) for v in values))}


def _check(logged: dict, want: dict[str, float], tensor: str, layer: str) -> None:
    for key, value in want.items():
        got = logged[layer_key(key, tensor, layer)]
        assert got == pytest.approx(value, rel=1e-5, abs=1e-12), (key, tensor, layer)


def _logged(rank: dict, step: int) -> dict[str, float]:
    return rank["metrics"][str(step)]


def _same_on_both_ranks(ranks: list[dict]) -> None:
    """Both ranks judged the same pooled tables and took the same decisions, and rank 0 logged
    those tables (rank 1 nothing)."""
    r0, r1 = ranks
    assert r0["tables"] == r1["tables"] and r0["tables"]
    assert r0["fallbacks"] == r1["fallbacks"]
    assert r1["metrics"] == {}
    for step, table in r0["tables"].items():
        for row, stats in table.items():
            layer, tensor = row.split("|")
            for key, value in stats.items():
                logged = r0["metrics"][step][layer_key(key, tensor, layer)]
                assert logged == value or (math.isnan(logged) and math.isnan(value)), key


def test_a_nan_and_inf_on_one_rank_are_counted_once_and_the_rest_pooled(results):
    ranks = results("nonfinite")
    _same_on_both_ranks(ranks)
    logged = {step: _logged(ranks[0], step) for step in (2, 4)}
    # step 2: rank 1's input holds one NaN and one Inf; the FP8 layer 0 casts both ranks' inputs
    # with the one scale TE's reduce_amax gives them
    scale = ranks[0]["scales"]["2"]["0"]["fwd_scale"][emulate.FWD_INPUT]
    assert scale == ranks[1]["scales"]["2"]["0"]["fwd_scale"][emulate.FWD_INPUT]
    want = _reference([(p, scale) for p in _pieces(ranks, 2, "activation", "0")], "e4m3")
    assert (want["nan_count"], want["inf_count"]) == (1, 1)
    _check(logged[2], want, "activation", "0")
    # layer 2 (what-if, current scaling): each rank's own scale, rank 1's 1 (its amax is Inf)
    for tensor, layer, step in (("activation", "2", 2), ("gradient", "0", 2),
                                ("gradient", "2", 4), ("gradient", "0", 4)):
        fmt = FORMAT[tensor]
        pieces = _pieces(ranks, step, tensor, layer)
        want = _reference([(p, _te_scale(p, fmt)) for p in pieces], fmt)
        assert want["nan_count"] > 0
        if layer == "2":
            _check(logged[step], want, tensor, layer)
        else:  # the FP8 layer's gradient: its shared backward scale
            bwd = ranks[0]["scales"][str(step)]["0"]["bwd_scale"][emulate.BWD_GRAD_OUTPUT]
            _check(logged[step], _reference([(p, bwd) for p in pieces], fmt), tensor, layer)
    assert logged[4][layer_key("nan_count", "gradient", "2")] == 1
    assert ranks[0]["done"] == ranks[1]["done"] == 4


def test_a_rank_with_all_zero_inputs_leaves_the_scale_to_the_other(results):
    ranks = results("zeros")
    _same_on_both_ranks(ranks)
    r0 = _logged(ranks[0], 2)
    [zeros, values] = [_pieces([r], 2, "activation", "0")[0] for r in reversed(ranks)]
    assert not any(zeros)
    # current scaling what-if: rank 1 casts at 1 (amax 0), which pools to nothing
    want = _reference([(values, _te_scale(values, "e4m3")), (zeros, 1.0)], "e4m3")
    assert want["scale"] == _te_scale(values, "e4m3")
    _check(r0, want, "activation", "0")
    assert r0[layer_key("amin", "activation", "0")] == min(abs(v) for v in values if v)
    # the FP8 layer: one scale on both ranks (reduce_amax), rank 1's zeros in every count
    scale = ranks[0]["scales"]["2"]["2"]["fwd_scale"][emulate.FWD_INPUT]
    pieces = _pieces(ranks, 2, "activation", "2")
    assert not any(pieces[1])
    _check(r0, _reference([(p, scale) for p in pieces], "e4m3"), "activation", "2")


def test_a_rank_with_all_zero_inputs_at_its_own_scale_leaves_the_scale_to_the_other(results):
    """Without reduce_amax rank 1's delayed scale stays 1 (its amax is 0): its zeros cast the
    same at any scale, so the pooled `scale` is rank 0's (before: 1, which read as a stale scale
    to the stale-scale rule, scale / current_scale 0.0097, where rank 0 cast at 179)."""
    ranks = results("zeros_local")
    _same_on_both_ranks(ranks)
    scales = [r["scales"]["2"]["2"]["fwd_scale"][emulate.FWD_INPUT] for r in ranks]
    assert scales[1] == 1.0 and scales[0] > 100
    pieces = _pieces(ranks, 2, "activation", "2")
    want = _reference(list(zip(pieces, scales, strict=True)), "e4m3")
    assert want["scale"] == scales[0]
    _check(_logged(ranks[0], 2), want, "activation", "2")


def _delayed_scale(step: int, tensor: str, layer: str, ranks: list[dict]) -> float:
    """The delayed what-if scale at `step` under amax_history_len 2: fp8_max over the largest
    amax of the 2 batches before it, over the micro-batches of `ranks` (TE's fused update,
    common/recipe/delayed_scaling.cu:162-253 at v2.18: the history's max, row 0 the new amax)."""
    fmt = FORMAT[tensor]
    amax = max(abs(v) for s in (step - 2, step - 1) for p in _pieces(ranks, s, tensor, layer)
               for v in p if math.isfinite(v))
    return f32(FP8_MAX[fmt] / f32(amax))


def test_without_reduce_amax_each_rank_casts_with_its_own_what_if_scale(results):
    ranks = results("whatif_local")
    _same_on_both_ranks(ranks)
    r0 = _logged(ranks[0], 3)
    for tensor in ("activation", "gradient"):
        for layer in WATCHED:
            fmt = FORMAT[tensor]
            want = _reference([(p, _delayed_scale(3, tensor, layer, [r]))
                               for r in ranks for p in _pieces([r], 3, tensor, layer)], fmt)
            _check(r0, want, tensor, layer)
    # rank 1's activation is 16 times rank 0's: its scale is the smaller one logged
    assert r0[layer_key("scale", "activation", "0")] == _delayed_scale(
        3, "activation", "0", [ranks[1]])


def test_ranks_with_different_micro_batch_counts_pool_every_micro_batch(results):
    ranks = results("microbatches")
    _same_on_both_ranks(ranks)
    assert [len(_pieces([r], 3, "activation", "0")) for r in ranks] == [2, 1]
    r0 = _logged(ranks[0], 3)
    for tensor in ("activation", "gradient"):
        for layer in WATCHED:
            fmt = FORMAT[tensor]
            scale = _delayed_scale(3, tensor, layer, ranks)  # reduce_amax
            want = _reference([(p, scale) for p in _pieces(ranks, 3, tensor, layer)], fmt)
            _check(r0, want, tensor, layer)
    assert r0[layer_key("nan_count", "activation", "0")] == 1


def test_a_bug_at_a_micro_batchs_start_on_one_rank_switches_fp8_stats_off_on_both(results):
    """Before: the error left BEFORE_FORWARD on rank 1, ending its fit; rank 0 waited in the
    next collective until gloo's timeout."""
    ranks = results("bug_microbatch")
    steps = SCENARIOS["bug_microbatch"]["steps"]
    assert [r["done"] for r in ranks] == [steps - 1] * 2
    assert ranks[0]["stats_disabled"] and ranks[1]["stats_disabled"]
    assert ranks[0]["metrics"] == {}  # off at the first logging step, before logging it
    assert ranks[0]["fallbacks"] == ranks[1]["fallbacks"]


def test_a_guard_bug_before_its_vote_on_one_rank_switches_it_off_on_both(results):
    """Before: rank 1 left the vote's all_reduce, rank 0's was paired with rank 1's next
    collective (fp8_stats' pooling: layer 0 'flagged on another rank' fell back from those
    numbers) and then waited until gloo's timeout."""
    ranks = results("bug_listen")
    steps = SCENARIOS["bug_listen"]["steps"]
    assert [r["done"] for r in ranks] == [steps - 1] * 2
    assert ranks[0]["guard_disabled"] and ranks[1]["guard_disabled"]
    assert all(not f for r in ranks for f in r["fallbacks"].values())
    assert not ranks[0]["stats_disabled"] and not ranks[1]["stats_disabled"]
    assert ranks[0]["tables"] == ranks[1]["tables"] and sorted(ranks[0]["metrics"]) == ["0", "2"]


def test_a_piece_with_nothing_to_scale_leaves_the_pooled_scale_to_the_others():
    """The pooling itself, without ranks: an all-zero piece at its own delayed scale 1 pooled
    with one cast at 179 gives 179; alone, or with an all-NaN piece, the scale it was cast at."""
    x = torch.linspace(-4.0, 4.0, 64)
    zeros, nans = torch.zeros(64), torch.full((8,), float("nan"))
    pooled = pool_sufficient_stats(sufficient_stats(zeros, "e4m3", 1.0),
                                   sufficient_stats(x, "e4m3", 179.0))
    assert dict(zip(STAT_KEYS, finalize_stats(pooled).tolist(), strict=True))["scale"] == 179.0
    idle = pool_sufficient_stats(sufficient_stats(zeros, "e4m3", 2.0),
                                 sufficient_stats(nans, "e4m3", 4.0))
    assert dict(zip(STAT_KEYS, finalize_stats(idle).tolist(), strict=True))["scale"] == 2.0
