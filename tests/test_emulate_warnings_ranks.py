"""The emulation's warnings in a run of two gloo ranks (torch.multiprocessing spawn): one copy
per run, from rank 0, not one per rank. Every rank of a data-parallel run meets the same layers,
recipe and environment, so each rank gave the same warning and a user's console (torchrun and
Composer's launcher interleave the ranks' stderr) held it once per rank: 8 copies of each on a
node of 8 GPUs."""

from __future__ import annotations

import json
import warnings

import torch

from foundry_fp8.emulate import UNFUSED_UPDATE_ENV, EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe
from tests.ranks import WORLD_SIZE, init_rank, run_ranks


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    import os

    os.environ[UNFUSED_UPDATE_ENV] = "1"
    init_rank(rank, rendezvous)
    try:
        layer = EmulatedFP8Linear(64, 24)  # out_features 24: TE's FP8 backward refuses it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # what the user's console would print, every copy
            for length in (5, 8, 7):  # 5 and 7 tokens: TE's forward refuses them
                with fp8_autocast(recipe=FP8Recipe()):
                    layer(torch.randn(length, 64)).sum().backward()
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump([str(w.message) for w in caught], f)
    finally:
        torch.distributed.destroy_process_group()


def test_each_warning_is_printed_once_per_run_by_rank_0(tmp_path):
    run_ranks(_worker, str(tmp_path))
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text())
            for rank in range(WORLD_SIZE)]
    kinds = {"TransformerEngine stops the forward": "forward",
             "Caller must pad": "backward", UNFUSED_UPDATE_ENV: "unfused"}
    got = [sorted(kind for text in messages for key, kind in kinds.items() if key in text)
           for messages in seen]
    assert got == [["backward", "forward", "unfused"], []]
    assert "input of shape [5, 64]" in next(m for m in seen[0] if "stops the forward" in m)
