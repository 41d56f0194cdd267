"""What reaches W&B, checked where the user looks: a real tiny LLM-Foundry training with
Composer's `WandBLogger` (offline), its `.wandb` file read back with W&B's own reader
(`foundry_fp8.wandb_history`), never "the logger was called" or "the folder exists"."""

from __future__ import annotations

import pytest

from foundry_fp8 import wandb_history
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.numerics import STAT_KEYS
from tests.tiny_run import run_folder, run_tiny

INTERVAL = 4
BATCHES = 12
RESUME_AT = 8
LINEARS = ("attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj")
TENSORS = ("activation", "weight", "gradient")


def _layer_keys() -> set[str]:
    """Every per-layer series of the tiny MPT (2 blocks x 4 linears x 3 tensors x stats)."""
    return {f"fp8/model.transformer.blocks.{block}.{linear}/{tensor}/{stat}"
            for block in (0, 1) for linear in LINEARS for tensor in TENSORS for stat in STAT_KEYS}


def _overrides(run_name: str, **extra) -> dict:
    return {"variables": {"run_name": run_name}, "max_duration": f"{BATCHES}ba",
            "save_interval": f"{RESUME_AT}ba", "eval_interval": f"{BATCHES}ba",
            "console_log_interval": f"{INTERVAL}ba",
            "callbacks": {"fp8_stats": {"interval": f"{INTERVAL}ba"}}, **extra}


def _logging_steps(run: wandb_history.WandbRun) -> list[int]:
    """The steps of Composer's own `loss/train/total` rows at fp8_stats' logging batches: where
    a user lines the FP8 statistics up with the loss."""
    return [step for step in run.steps("loss/train/total") if step % INTERVAL == 0]


@pytest.mark.slow
def test_every_fp8_series_reaches_the_wandb_history_at_the_loss_steps_and_after_resume(
        tmp_path, tiny_data):
    run_tiny(tmp_path, tiny_data, _overrides("full"), wandb=True)
    [run] = wandb_history.read_runs(run_folder(tmp_path, "full"))
    assert _logging_steps(run) == [0, 4, 8]  # the loss is where Composer logs it: 0 .. 11
    assert run.steps("loss/train/total") == list(range(BATCHES))
    for key in sorted(_layer_keys()):
        assert run.steps(key) == [0, 4, 8], key
    assert {k for k in run.keys() if k.startswith("fp8")} == _layer_keys() | {
        f"fp8/model.transformer.blocks.{b}.{linear}/{t}/initial_scale"
        for b in (0, 1) for linear in LINEARS for t in TENSORS}

    # resume from the step-8 checkpoint: W&B offline starts a new run file, whose history goes
    # on at the resumed steps; the JSONL sink holds them too
    checkpoint = run_folder(tmp_path, "full") / "checkpoints" / f"ep0-ba{RESUME_AT}-rank0.pt"
    run_tiny(tmp_path, tiny_data, _overrides("resumed", load_path=str(checkpoint)), wandb=True)
    [resumed] = wandb_history.read_runs(run_folder(tmp_path, "resumed"))
    assert resumed.steps("loss/train/total") == list(range(RESUME_AT, BATCHES))
    assert _logging_steps(resumed) == [8]
    for key in sorted(_layer_keys()):
        assert resumed.steps(key) == [8], key
    jsonl = [(step, m) for step, m in read_jsonl(run_folder(tmp_path, "resumed") / "metrics.jsonl")
             if any(k.startswith("fp8/") for k in m)]
    assert [step for step, _ in jsonl] == [8]
    assert _layer_keys() <= jsonl[0][1].keys()
    # the same step of the same model state gives the same statistics in both runs
    full_row = next(row for row in run.rows if row["_step"] == 8 and "fp8/model.transformer."
                    "blocks.0.attn.Wqkv/weight/amax" in row)
    resumed_row = next(row for row in resumed.rows if "fp8/model.transformer.blocks.0.attn.Wqkv"
                       "/weight/amax" in row)
    assert resumed_row["fp8/model.transformer.blocks.0.attn.Wqkv/weight/amax"] == \
        full_row["fp8/model.transformer.blocks.0.attn.Wqkv/weight/amax"]
