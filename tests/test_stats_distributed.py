"""FP8 statistics pooled across 2 CPU ranks (gloo): equal to the statistics of both ranks'
tensors taken together where that is their meaning, identical on every rank; and a failure on
one rank (in a hook, at FIT_START, in start_step, in a dump, in finish_step) switches fp8_stats
off on every rank together instead of leaving the others in a collective for ever."""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import pkgutil
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as torch_dist
from composer.core import Event
from composer.devices import DeviceCPU
from torch import nn

from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.health import layer_key
from foundry_fp8.monitor import FP8Monitor, FP8MonitorError, MonitorConfig, Schedule
from foundry_fp8.numerics import (
    STAT_KEYS,
    all_reduce_sufficient_stats,
    finalize_stats,
    sufficient_stats,
    tensor_stats,
)
from tests.ranks import init_rank, run_ranks
from tests.test_numerics import pooled_rel, ref_round

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
    init_rank(rank, port)
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
        recipe = {"scaling": "delayed", "amax_history_len": 2}
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
    run_ranks(_worker, str(out))
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
            assert pooled[key] == pytest.approx(whole[key], rel=pooled_rel(key)), key
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
        assert metrics[layer_key(key, "activation", "0")] == pytest.approx(value, rel=1e-5), key  # float32 q
    assert metrics[layer_key("scale", "activation", "0")] == pytest.approx(min(s for _, s in parts))
    assert metrics[layer_key("scale_ratio", "activation", "0")] == pytest.approx(1.0)
    # the weight is the same on both ranks: pooled = the stats of the one weight
    weight = _weights()[0].weight.detach()
    for key, value in tensor_stats(weight).items():
        assert metrics[layer_key(key, "weight", "0")] == pytest.approx(value, rel=1e-9), key
    # d(sum)/d(output) = 1 everywhere, on both ranks: exact in FP8
    assert metrics[layer_key("amax", "gradient", "0")] == 1.0 and metrics[layer_key("mse", "gradient", "0")] == 0.0


def test_delayed_whatif_reduces_amax_across_ranks(results):
    metrics = results[0]["delayed"]
    assert metrics == results[1]["delayed"]
    # step 3 casts with 448 / max over both ranks of steps 1-2's amaxes (history 2)
    amax = max(_inputs(r, s).abs().max().item() for r in range(2) for s in (1, 2))
    scale = torch.tensor(448.0) / torch.tensor(amax)  # float32, as the scale is stored
    assert metrics[layer_key("scale", "activation", "0")] == scale.item()
    both = torch.cat([_inputs(0, 3), _inputs(1, 3)])
    for key, value in tensor_stats(both, scale=scale).items():
        assert metrics[layer_key(key, "activation", "0")] == pytest.approx(
            value, rel=max(pooled_rel(key), 1e-9)), key


def test_a_failure_on_one_rank_stops_every_rank(results):
    assert "1 rank(s)" in results[0]["raised"]
    assert "hook failed on rank 1" in results[1]["raised"]


# fp8_stats over 2 ranks, driven through Composer's events around a hand-written training loop;
# each scenario breaks one function on rank 1 only (on its `call`-th call)


class _Logger:
    """What the callback uses of Composer's Logger, which is also its one (non-console)
    destination: fp8_stats logs through `logger.destinations`."""

    def __init__(self):
        self.metrics: dict[int, dict] = {}
        self.destinations = [self]

    def log_images(self, *args, **kwargs):
        pass

    def log_table(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step):
        self.metrics.setdefault(step, {}).update(metrics)

    def log_hyperparameters(self, hparams):
        pass


def _train(rank: int, callback: FP8Stats | None, steps: int,
           destinations: Sequence[JSONLLogger] = ()) -> tuple[nn.Module, _Logger]:
    model = _weights()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = types.SimpleNamespace(model=model, run_name="run", callbacks=[], device=DeviceCPU(),
                                  timestamp=types.SimpleNamespace(batch=0))
    logger = _Logger()
    logger.destinations += destinations
    for destination in destinations:  # Composer's Logger calls it at INIT
        destination.init(state, logger)
    events = callback.run_event if callback else lambda *_: None
    events(Event.FIT_START, state, logger)
    for batch in range(steps):
        state.timestamp.batch = batch
        events(Event.BATCH_START, state, logger)
        optimizer.zero_grad()
        model(_inputs(rank, batch)).sum().backward()
        events(Event.AFTER_TRAIN_BATCH, state, logger)
        optimizer.step()
        state.timestamp.batch = batch + 1  # Composer counts the batch before BATCH_END
        events(Event.BATCH_END, state, logger)
    events(Event.FIT_END, state, logger)
    return model, logger


def _breaks(target: str, call: int) -> Callable[..., object]:
    """`target` that raises on its `call`-th call (a TypeError: neither OSError nor ours)."""
    original = pkgutil.resolve_name(target)
    calls = itertools.count(1)

    def broken(*args, **kwargs):
        if next(calls) == call:
            raise TypeError(f"injected failure on rank 1 in {target.rsplit('.', 1)[-1]}")
        return original(*args, **kwargs)

    return broken


DELAYED = {"scaling": "delayed", "amax_history_len": 2}
# name: (fp8_stats options, steps, function broken on rank 1, on which call, the step the ranks
# stop at: rank 0 logs the logging steps before it)
SCENARIOS: dict[str, tuple[dict, int, str | None, int, int | None]] = {
    "clean": ({"interval": 2}, 5, None, 0, None),
    "fit_start": ({"interval": 2}, 5, "foundry_fp8.composer.stats.FP8Monitor", 1, 0),
    # logging steps 0, 2, 4: hooks are registered at steps 0 and 2
    "start_step": ({"interval": 2}, 5, "torch.nn.Linear.register_forward_pre_hook", 2, 2),
    "dump": ({"interval": 2, "dump_steps": [1]}, 5, "safetensors.torch.save_file", 1, 1),
    # logging steps 0, 3, 6, recording every step: the what-if update of step 1 (a recording
    # step: rank 1 then joins step 2's amax all_reduce) or of step 3, before its pooling
    "fold_recording": ({"interval": 3, "recipe": DELAYED}, 7,
                       "foundry_fp8.monitor.delayed_scale_update", 2, 3),
    "fold_logging": ({"interval": 3, "recipe": DELAYED}, 7,
                     "foundry_fp8.monitor.delayed_scale_update", 4, 3),
    "strict_dump": ({"interval": 2, "dump_steps": [1], "strict": True}, 5,
                    "safetensors.torch.save_file", 1, 1),
}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))  # with the traceback


def _scenario(rank: int, name: str, out_dir: str) -> dict:
    options, steps, target, call, _ = SCENARIOS[name]
    callback = FP8Stats(**{"dump_folder": f"{out_dir}/{name}-dumps", **options})
    broken = (mock.patch(target, _breaks(target, call)) if target and rank == 1
              else contextlib.nullcontext())
    handler = _Lines()
    logging.getLogger("foundry_fp8").addHandler(handler)
    try:
        with broken:
            model, logger = _train(rank, callback, steps)
    except FP8MonitorError as e:
        return {"raised": str(e)}
    finally:
        logging.getLogger("foundry_fp8").removeHandler(handler)
    reference, _ = _train(rank, None, steps)
    return {"disabled": callback.disabled, "metrics": logger.metrics,
            "log": "\n".join(handler.lines),
            "trained_alike": all(torch.equal(a, b) for a, b in
                                 zip(model.parameters(), reference.parameters(), strict=True)),
            "hooks_left": any(m._forward_pre_hooks or m._backward_pre_hooks for m in model)}


JSONL_DUMPS = "jsonl_dumps"


def _jsonl_dumps(rank: int, out_dir: str) -> list[str]:
    """fp8_stats dumping with a `jsonl` logger whose path is absolute: every rank's dump file
    goes beside the metrics file that only rank 0 writes. Returns the dump files under this
    scenario's folder, the working directory too (where `runs/<run_name>` would be)."""
    root = Path(out_dir) / JSONL_DUMPS
    (root / "cwd").mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(root / "cwd")
    try:
        jsonl = JSONLLogger(path=f"{root}/{{run_name}}/metrics.jsonl")
        _train(rank, FP8Stats(interval=2, dump_steps=[1]), 3, [jsonl])
    finally:
        os.chdir(cwd)
    torch_dist.barrier()  # both ranks have written
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.safetensors"))


def _callback_worker(rank: int, port: int, out_dir: str, names: list[str]) -> None:
    init_rank(rank, port)
    try:
        for name in names:
            result = (_jsonl_dumps(rank, out_dir) if name == JSONL_DUMPS
                      else _scenario(rank, name, out_dir))
            torch.save(result, f"{out_dir}/{name}-rank{rank}.pt")
            torch_dist.barrier()
    finally:
        torch_dist.destroy_process_group()


@pytest.fixture(scope="module")
def callback_results(tmp_path_factory) -> Callable[[str], list[dict]]:
    """Every scenario in one 2-process run."""
    out = tmp_path_factory.mktemp("callback")
    run_ranks(_callback_worker, str(out), [*SCENARIOS, JSONL_DUMPS])

    def results(name: str) -> list[dict]:
        paths = [out / f"{name}-rank{r}.pt" for r in range(2)]
        missing = [p.name for p in paths if not p.exists()]
        assert not missing, f"{name}: no result from {missing}: a rank hung or died"
        return [torch.load(p, weights_only=False) for p in paths]

    return results


def test_without_failures_the_callback_logs_the_same_pooled_numbers(callback_results, results):
    ranks = callback_results("clean")
    assert not ranks[0]["disabled"] and not ranks[1]["disabled"]
    assert sorted(ranks[0]["metrics"]) == [0, 2, 4] and ranks[1]["metrics"] == {}
    assert ranks[0]["metrics"][0] == results[0]["current"]  # bit for bit
    assert all(r["trained_alike"] and not r["hooks_left"] for r in ranks)
    assert "failed" not in ranks[0]["log"] + ranks[1]["log"]


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n not in ("clean", "strict_dump")])
def test_a_failure_on_one_rank_switches_every_rank_off_together(callback_results, name):
    ranks = callback_results(name)
    stop = SCENARIOS[name][-1]
    assert ranks[0]["disabled"] and ranks[1]["disabled"]
    assert all(r["trained_alike"] and not r["hooks_left"] for r in ranks)  # training unaffected
    logging_steps = [s for s in range(stop) if FP8Stats(**SCENARIOS[name][0]).schedule.logs(s)]
    assert sorted(ranks[0]["metrics"]) == logging_steps
    assert "TypeError: injected failure on rank 1" in ranks[1]["log"]
    assert "injected failure" not in ranks[0]["log"]
    if name == "fit_start":
        assert "failed to start on another rank" in ranks[0]["log"]
    else:  # both ranks report the pooled failure
        assert all("failed on 1 rank(s)" in r["log"] for r in ranks)


def test_strict_raises_on_every_rank_at_the_pooling(callback_results):
    """A failure the monitor catches (here a dump's) still reaches the pooling on every rank,
    where `strict: true` raises on all of them together."""
    ranks = callback_results("strict_dump")
    assert all("failed on 1 rank(s)" in r["raised"] for r in ranks)
    assert "injected failure on rank 1" in ranks[1]["raised"]


def test_every_ranks_dumps_land_in_the_jsonl_loggers_folder(callback_results):
    """Only rank 0 writes the `jsonl` logger's file, but every rank resolves its path: rank 1's
    dump goes beside rank 0's, not into `runs/<run_name>` of its working directory."""
    for files in callback_results(JSONL_DUMPS):
        assert files == [f"run/fp8_dumps/step0000001-rank{rank}.safetensors" for rank in (0, 1)]
