"""Two CPU processes over gloo for the multi-rank tests, under a deadline: a rank that hangs or
dies leaves its results missing, so its test fails instead of blocking the suite. The ranks meet
through a file of their own, not a TCP port: a free port picked and released can be taken by
another process group (tests run side by side) and mix two groups' collectives. The ranks are
forked from the session's forkserver (tests/forked.py), which imported torch and Composer once."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from composer.core import Event

from foundry_fp8.emulate import fp8_autocast
from tests.forked import as_spawned, forkserver

WORLD_SIZE = 2


def init_rank(rank: int, rendezvous: str) -> None:
    """Join the 2-rank gloo group; collectives give up after a minute rather than wait for ever."""
    # Composer's dist reads these too (a Trainer earlier in the session may have set them to 1)
    os.environ.update(WORLD_SIZE=str(WORLD_SIZE), RANK=str(rank), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE), NODE_RANK="0")
    torch_dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                                  world_size=WORLD_SIZE, timeout=timedelta(seconds=60))


def run_ranks(worker: Callable[..., None], *args: Any, deadline_s: float = 180.0) -> None:
    """`worker(rank, rendezvous, *args)` on both ranks; whatever is still running at the
    deadline is killed. A rank that raised is reported on stdout; its test then finds no
    result."""
    folder = tempfile.mkdtemp(prefix="ranks-")
    rendezvous = os.path.join(folder, "store")
    output = os.path.join(folder, "output")
    forkserver()
    context = mp.start_processes(
        as_spawned, args=(_rank, dict(os.environ), os.getcwd(), output, worker, rendezvous, *args),
        nprocs=WORLD_SIZE, join=False, start_method="forkserver")
    deadline = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=1) and time.monotonic() < deadline:
            pass
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(e)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        if os.path.exists(output):  # the ranks' own prints and tracebacks, for a failing test
            with open(output, errors="replace") as f:
                print(f.read()[-20000:])
        shutil.rmtree(folder, ignore_errors=True)


def _rank(rank: int, worker: Callable[..., None], *args: Any) -> None:
    """`worker(rank, *args)`, its `destroy_process_group` made safe from torch 2.7's gloo
    deadlock: the group's destructor joins its worker thread holding the GIL while that thread,
    freeing the last collective's tensors, waits for the GIL (gdb: ~ProcessGroupGloo in
    std::thread::join, runLoop in ~AsyncWork -> gil_scoped_acquire). It hung 4 runs of 10 until
    run_ranks' deadline, spawned or forked alike. A pause, GIL released, lets the thread finish."""
    destroy = torch_dist.destroy_process_group

    def settled_destroy(*a: Any, **kw: Any) -> None:
        time.sleep(0.5)
        destroy(*a, **kw)

    torch_dist.destroy_process_group = settled_destroy
    worker(rank, *args)


def train_batches(model: torch.nn.Module, optimizer: torch.optim.Optimizer, callbacks: list,
                  state: Any, logger: Any, recipe: Any, steps: int, rank: int, *,
                  sync_grads: bool = False) -> Iterator[int]:
    """The batches of a Composer fit as our callbacks see them, on this rank's own data: yields
    each batch once its events ran. `sync_grads`: the gradient all_reduce DDP runs, a collective
    of another size between the callbacks' own."""
    gen = torch.Generator().manual_seed(rank)
    for batch in range(steps):
        state.timestamp.batch = batch
        for callback in callbacks:
            callback.run_event(Event.BATCH_START, state, logger)
        optimizer.zero_grad()
        with fp8_autocast(recipe=recipe):
            loss = model(torch.randn(16, 32, generator=gen)).mean()
        loss.backward()
        if sync_grads:
            for p in model.parameters():
                torch_dist.all_reduce(p.grad)
        optimizer.step()
        state.timestamp.batch = batch + 1
        for event in (Event.AFTER_TRAIN_BATCH, Event.BATCH_END, Event.BATCH_CHECKPOINT):
            for callback in callbacks:
                callback.run_event(event, state, logger)
        yield batch


class StepLogger:
    """Composer's Logger and its one destination, for callbacks driven by hand on each rank:
    the metrics by step; hyperparameters, images and tables dropped."""

    def __init__(self) -> None:
        self.metrics: dict[int, dict] = {}
        self.destinations = [self]

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.metrics.setdefault(step, {}).update(metrics)

    def log_hyperparameters(self, hparams: dict) -> None:
        pass

    def log_images(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_table(self, *args: Any, **kwargs: Any) -> None:
        pass
