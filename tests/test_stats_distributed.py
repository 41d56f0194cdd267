"""FP8 statistics pooled across 2 CPU ranks (gloo): equal to the statistics of both ranks'
tensors taken together where that is their meaning, identical on every rank, and a hook failure
on one rank stops the monitor on all ranks instead of hanging them."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from torch import nn

from foundry_fp8.monitor import FP8Monitor, FP8MonitorError, MonitorConfig, Schedule, parse_recipe
from foundry_fp8.numerics import (
    STAT_KEYS,
    all_reduce_sufficient_stats,
    finalize_stats,
    sufficient_stats,
    tensor_stats,
)
from tests.test_numerics import ref_round

SCALE = 448.0 / 64.0


def _rank_tensor(rank: int) -> torch.Tensor:
    """Different sizes, ranges and NaN/Inf per rank."""
    gen = torch.Generator().manual_seed(10 + rank)
    n = 1500 + 700 * rank
    x = torch.randn(n, generator=gen) * torch.logspace(-9 + rank, 2 + rank, n)
    x[3 + rank] = float("nan") if rank else float("inf")
    return x


def _inputs(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 8, generator=gen) * (1 + 3 * rank) * (step + 1)


def _weights() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 4, bias=False))


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE="2", NODE_RANK="0")
    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                  world_size=2)
    result: dict = {}
    try:
        # 1. the numerics: one all_reduce per op over stacked rows
        rows = torch.stack([sufficient_stats(_rank_tensor(rank), "e4m3", SCALE),
                            sufficient_stats(_rank_tensor(rank), "e5m2")])
        all_reduce_sufficient_stats(rows)
        result["pooled"] = finalize_stats(rows).tolist()

        # 2. the monitor, current scaling (each rank casts with its own amax)
        model = _weights()
        monitor = FP8Monitor(model, MonitorConfig(), on_warning=lambda _: None)
        monitor.start_step()
        model(_inputs(rank, 0)).sum().backward()
        result["current"] = monitor.finish_step()

        # 3. a delayed what-if with reduce_amax: every rank casts with the same scale
        recipe = parse_recipe({"scaling": "delayed", "amax_history_len": 2})
        monitor = FP8Monitor(model, MonitorConfig(recipe=recipe), on_warning=lambda _: None,
                             schedule=Schedule(interval=3))
        for step in range(4):
            monitor.start_step(step)
            model(_inputs(rank, step)).sum().backward()
            metrics = monitor.finish_step()
        result["delayed"] = metrics

        # 4. a hook failure on rank 1 only: both ranks raise at the same logging step
        monitor = FP8Monitor(model, MonitorConfig())
        monitor.start_step()
        model(_inputs(rank, 0)).sum().backward()
        if rank == 1:
            monitor.error = RuntimeError("hook failed on rank 1")
        try:
            monitor.finish_step()
            result["raised"] = None
        except FP8MonitorError as e:
            result["raised"] = str(e)
        torch.save(result, f"{out_dir}/rank{rank}.pt")
        torch_dist.barrier()  # destroying while the peer is mid-collective can hang (torch #75097)
    finally:
        torch_dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Every scenario in one 2-process run (starting the processes dominates the cost)."""
    out = tmp_path_factory.mktemp("ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(out)), nprocs=2, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_pooled_stats_equal_the_stats_of_the_concatenation(results):
    both = torch.cat([_rank_tensor(0), _rank_tensor(1)])
    for row, (fmt, scale) in zip(results[0]["pooled"], [("e4m3", SCALE), ("e5m2", None)],
                                 strict=True):
        pooled = dict(zip(STAT_KEYS, row, strict=True))
        if scale is None:  # current scaling: each rank's own amax, so compare the parts that
            whole = tensor_stats(both, fmt)  # do not depend on it
            keys = ("amax", "amin", "nan_count", "inf_count", "current_scale", "scale")
        else:
            whole = tensor_stats(both, fmt, scale=scale)
            keys = STAT_KEYS
        for key in keys:
            assert pooled[key] == pytest.approx(whole[key], rel=1e-12), key
    assert results[0]["pooled"] == results[1]["pooled"]


def _ref_pooled(parts: list[tuple[list[float], float]], fmt: str) -> dict[str, float]:
    """Float64 reference: each rank's values cast with its own scale, then pooled."""
    xs, qs = [], []
    for values, scale in parts:
        xs += values
        qs += [ref_round(v * scale, fmt) / scale for v in values]
    n = len(xs)
    dot = sum(a * b for a, b in zip(xs, qs, strict=True))
    return {"underflow_pct": 100.0 * sum(1 for a, q in zip(xs, qs, strict=True) if a and not q) / n,
            "mse": sum((a - q) ** 2 for a, q in zip(xs, qs, strict=True)) / n,
            "cos_sim": dot / math.sqrt(sum(a * a for a in xs) * sum(q * q for q in qs)),
            "amax": max(abs(a) for a in xs), "amin": min(abs(a) for a in xs if a)}


def test_monitor_pools_current_scaling_per_rank_casts(results):
    metrics = results[0]["current"]
    assert metrics == results[1]["current"]
    xs = [_inputs(r, 0).reshape(-1).tolist() for r in range(2)]
    # each rank's current scale, float32 as TE stores it
    parts = [(x, (torch.tensor(448.0) / torch.tensor(max(abs(v) for v in x))).item()) for x in xs]
    want = _ref_pooled(parts, "e4m3")
    for key, value in want.items():
        assert metrics[f"fp8/0/activation/{key}"] == pytest.approx(value, rel=1e-5), key  # float32 q
    assert metrics["fp8/0/activation/scale"] == pytest.approx(min(s for _, s in parts))
    assert metrics["fp8/0/activation/scale_ratio"] == pytest.approx(1.0)
    # the weight is the same on both ranks: pooled = the stats of the one weight
    weight = _weights()[0].weight.detach()
    for key, value in tensor_stats(weight).items():
        assert metrics[f"fp8/0/weight/{key}"] == pytest.approx(value, rel=1e-9), key
    # d(sum)/d(output) = 1 everywhere, on both ranks: exact in FP8
    assert metrics["fp8/0/gradient/amax"] == 1.0 and metrics["fp8/0/gradient/mse"] == 0.0


def test_delayed_whatif_reduces_amax_across_ranks(results):
    metrics = results[0]["delayed"]
    assert metrics == results[1]["delayed"]
    # step 3 casts with 448 / max over both ranks of steps 1-2's amaxes (history 2)
    amax = max(_inputs(r, s).abs().max().item() for r in range(2) for s in (1, 2))
    scale = torch.tensor(448.0) / torch.tensor(amax)  # float32, as the scale is stored
    assert metrics["fp8/0/activation/scale"] == scale.item()
    both = torch.cat([_inputs(0, 3), _inputs(1, 3)])
    for key, value in tensor_stats(both, scale=scale).items():
        assert metrics[f"fp8/0/activation/{key}"] == pytest.approx(value, rel=1e-9), key


def test_a_failure_on_one_rank_stops_every_rank(results):
    assert "1 rank(s)" in results[0]["raised"]
    assert "hook failed on rank 1" in results[1]["raised"]
