"""The emulation's warnings in a run of two gloo ranks (torch.multiprocessing spawn): one line per
kind per run across the ranks, from the first rank that meets the kind, never none. Every rank
of a data-parallel run usually meets the same layers, recipe and environment, and torchrun and
Composer's launcher interleave the ranks' stderr: a copy per rank gave 8 copies of each on a
node of 8 GPUs. Rank 0 alone printing them left silent a shape only another rank met (a short
last batch on rank 3), the shape that stops real TE on that rank."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

from foundry_fp8.emulate import UNFUSED_UPDATE_ENV, EmulatedFP8Linear, fp8_autocast
from foundry_fp8.recipe import FP8Recipe
from tests.ranks import WORLD_SIZE, init_rank, run_ranks

KINDS = {"TransformerEngine stops the forward": "forward", "Caller must pad": "backward",
         UNFUSED_UPDATE_ENV: "unfused"}


def _steps(out_features: int, lengths: tuple[int, ...]) -> None:
    """A new layer's training steps, a token count per step."""
    layer = EmulatedFP8Linear(64, out_features)
    for length in lengths:
        with fp8_autocast(recipe=FP8Recipe()):
            layer(torch.randn(length, 64)).sum().backward()


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    """Two phases, each its own run: first the variable, a short batch and out_features 24 on
    rank 1 only; then every kind on both ranks, in two runs."""
    import os

    init_rank(rank, rendezvous)
    said: dict[str, list[str]] = {}
    try:
        for phase in ("rank1", "both"):
            torch.distributed.barrier()  # the ranks start each phase together
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")  # what the user's console would print
                if phase == "both":
                    os.environ[UNFUSED_UPDATE_ENV] = "1"
                    # out_features 24: TE's FP8 backward refuses it; 5 and 7 tokens: the forward
                    _steps(24, (5, 8, 7))
                    torch.distributed.barrier()  # both ranks done: a second run, alike
                    _steps(24, (8, 5))
                elif rank == 1:
                    os.environ[UNFUSED_UPDATE_ENV] = "1"
                    _steps(24, (16, 3))
                else:
                    os.environ.pop(UNFUSED_UPDATE_ENV, None)
                    _steps(32, (16, 16))
            said[phase] = [str(w.message) for w in caught]
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(said, f)
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def said(tmp_path_factory) -> dict[str, list[tuple[int, str, str]]]:
    """Per phase, (rank, kind, message) of each emulation warning the ranks printed."""
    out = tmp_path_factory.mktemp("ranks")
    run_ranks(_worker, str(out))
    seen = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    return {phase: [(rank, kind, message) for rank in range(WORLD_SIZE)
                    for message in seen[rank][phase]
                    for key, kind in KINDS.items() if key in message]
            for phase in ("rank1", "both")}


def test_a_kind_all_ranks_meet_is_printed_once_per_run(said):
    """Both ranks meet every kind in each of two runs (a new layer after FP8 ran): one line
    per kind per run in all, from whichever rank met it first, naming that rank."""
    lines = said["both"]
    assert sorted(kind for _, kind, _ in lines) == sorted(
        ["backward", "forward", "unfused"] * 2)
    for rank, _, message in lines:
        assert message.startswith(f"[rank {rank}] ")
    forward = [message for _, kind, message in lines if kind == "forward"]
    assert ["input of shape [5, 64]" in message for message in forward] == [True, True]


def test_a_kind_only_rank_1_meets_is_said_by_rank_1(said):
    """Rank 0's batches and layers fit TE; rank 1 has a 3-token batch, out_features 24 and
    NVTE_UNFUSED_FP8_UPDATE set. Rank-0-only printing said nothing at all."""
    lines = said["rank1"]
    assert sorted((rank, kind) for rank, kind, _ in lines) == [
        (1, "backward"), (1, "forward"), (1, "unfused")]
    forward = next(message for _, kind, message in lines if kind == "forward")
    assert re.match(r"\[rank 1\] EmulatedFP8Linear: FP8 input of shape \[3, 64\]", forward)
