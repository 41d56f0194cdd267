"""The emulation's once-per-run warnings across a torchrun restart, and without the private
store function. torchrun's agent keeps one TCPStore for its workers across `--max-restarts`
(torch 2.7, static and c10d rendezvous alike), and the restarted workers number their runs
from 0 again: with the kind and run alone in the store key, every kind claimed before the crash
stayed claimed, and no rank said anything in the restart a user is debugging. A torch without
`_get_default_store` raised ImportError inside the forward and stopped training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as torch_dist

from tests.conftest import REPO_ROOT
from tests.emulate_restart_worker import WORLD_SIZE, steps
from tests.ranks import init_rank, run_ranks


def _attempt(port: int, restart: int, out: Path) -> list[tuple[int, str]]:
    """Both ranks of one attempt, each a new process as torchrun starts them; (rank, line)
    for every emulation warning they printed."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
           "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": str(restart)}
    files = [out / f"attempt{restart}-rank{rank}-{len(list(out.iterdir()))}.json"
             for rank in range(WORLD_SIZE)]
    workers = [subprocess.Popen([sys.executable, "-m", "tests.emulate_restart_worker",
                                 str(port), str(rank), str(file)], cwd=REPO_ROOT, env=env)
               for rank, file in enumerate(files)]
    try:
        assert [worker.wait(timeout=180) for worker in workers] == [0] * WORLD_SIZE
    finally:
        for worker in workers:
            worker.kill()
    return [(rank, line) for rank, file in enumerate(files)
            for line in json.loads(file.read_text())]


def test_a_restart_on_the_same_store_says_each_kind_again(tmp_path):
    """The store outlives the attempts, as torchrun's agent store does. Attempt 0 and the
    restart (count 1) each print each kind once, from a rank they name; the old key left the
    restart silent. A second attempt 1 (the same restart's ranks over again) is silent: the
    key is the restart, not the process."""
    store = torch_dist.TCPStore("127.0.0.1", 0, WORLD_SIZE, is_master=True,
                                wait_for_workers=False, timeout=timedelta(seconds=60))
    for restart in (0, 1):
        lines = _attempt(store.port, restart, tmp_path)
        assert sorted(line.split("|")[1] for _, line in lines) == ["backward", "forward"], (
            restart, lines)
        for rank, line in lines:
            assert line.startswith(f"[rank {rank}]|"), (restart, lines)
    assert _attempt(store.port, 1, tmp_path) == []


def _no_store_worker(rank: int, rendezvous: str, out_dir: str) -> None:
    """Both ranks train with torch's private `_get_default_store` gone (a renamed function)."""
    from torch.distributed import distributed_c10d

    init_rank(rank, rendezvous)
    try:
        del distributed_c10d._get_default_store
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(steps()))
    finally:
        torch.distributed.destroy_process_group()


def test_without_the_private_store_function_every_rank_warns_and_trains(tmp_path):
    """The fallback: each rank that meets a kind says it, and the steps finish. The old import
    raised ImportError in the forward: no rank finished."""
    run_ranks(_no_store_worker, str(tmp_path))
    for rank in range(WORLD_SIZE):
        lines = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(lines) == [f"[rank {rank}]|backward", f"[rank {rank}]|forward"]
