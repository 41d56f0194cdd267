"""Every fp8_stats value the JSONL holds is in W&B's history at its step, across a resume: the
tiny MPT through LLM-Foundry's `train` with Composer's usual callbacks beside ours, evaluation
first and every few batches, gradient accumulation and an fp8_stats interval, then resumed from
its checkpoint twice, into the same run folder and W&B run id (`resume: allow`) and into a new
one. Read back at the sinks: each attempt's `.wandb` file with W&B's own reader, and W&B's own
log of the rows it dropped. (The original complaint: fp8_stats reached the JSONL, not W&B,
which drops a step lower than one it has seen.)"""

from __future__ import annotations

import math

import pytest

from foundry_fp8 import wandb_history
from foundry_fp8.jsonl import read_jsonl
from tests.tiny_run import run_folder, run_tiny

BATCHES = 10
INTERVAL = 2  # fp8_stats logs at 0, 2, 4, 6, 8
SAVED_AT = 5  # the checkpoint both resumes start from: between two logging steps
RUN_ID = "fp8-resumed-here"

Values = dict[tuple[str, int], float]


def _overrides(name: str, **extra) -> dict:
    return {
        "variables": {"run_name": name}, "max_duration": f"{BATCHES}ba",
        "eval_interval": "3ba", "eval_first": True, "eval_subset_num_batches": 1,
        "device_train_microbatch_size": 2,  # 4 micro-batches per batch of 8
        "console_log_interval": "1ba", "save_interval": f"{SAVED_AT}ba",
        "callbacks": {
            "speed_monitor": {"window_size": 2}, "lr_monitor": {}, "memory_monitor": {},
            "runtime_estimator": {},
            "optimizer_monitor": {"log_optimizer_metrics": True, "batch_log_interval": 1},
            "fp8_stats": {"interval": f"{INTERVAL}ba", "image_interval": "4ba"}},
        **extra}


def _fp8(metrics: dict, step: int) -> Values:
    return {(k, step): v for k, v in metrics.items()
            if k.startswith("fp8") and isinstance(v, float | int) and not isinstance(v, bool)}


def _attempts(folder) -> list[Values]:
    """The FP8 values of the JSONL, per attempt: the jsonl logger appends a resumed run's
    records to the same file, the next attempt's from the checkpoint's step back down."""
    attempts: list[Values] = [{}]
    last = -1
    for step, metrics in read_jsonl(folder / "metrics.jsonl"):
        if step <= SAVED_AT < last:
            attempts.append({})
        attempts[-1].update(_fp8(metrics, step))
        last = step
    return attempts


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _held(run: wandb_history.WandbRun) -> Values:
    assert run.complete, run.path
    assert wandb_history.dropped_steps(run.path) == [], run.path  # W&B's own log: none
    held: Values = {}
    for row in run.rows:
        held.update(_fp8(row, row["_step"]))
    return held


def _check(jsonl: Values, wandb: Values, steps: list[int]) -> None:
    assert sorted({s for _, s in jsonl}) == steps
    assert len(jsonl) > 200 * len(steps)  # 8 layers x 3 tensors x the statistics, per step
    assert wandb.keys() == jsonl.keys()
    assert [k for k, v in jsonl.items() if not _same(wandb[k], v)] == []


@pytest.mark.slow
def test_every_fp8_value_reaches_wandb_across_resumes_into_the_same_and_a_new_run_folder(
        tmp_path, tiny_data):
    wandb_same = {"wandb": {"init_kwargs": {"id": RUN_ID, "resume": "allow"}}}
    run_tiny(tmp_path, tiny_data, _overrides("first", loggers=wandb_same), wandb=True).close()
    checkpoint = run_folder(tmp_path, "first") / "checkpoints" / f"ep0-ba{SAVED_AT}-rank0.pt"
    saved = tmp_path / "saved.pt"  # the same-folder resume saves over it
    saved.write_bytes(checkpoint.read_bytes())
    run_tiny(tmp_path, tiny_data, _overrides("first", loggers=wandb_same, load_path=str(saved)),
             wandb=True).close()
    run_tiny(tmp_path, tiny_data, _overrides("new", load_path=str(saved)), wandb=True).close()

    # the same folder: two W&B files under the one id, two attempts in the one JSONL
    before, after = _attempts(run_folder(tmp_path, "first"))
    first, again = wandb_history.read_runs(run_folder(tmp_path, "first"), wait=120)
    assert first.path.name == again.path.name == f"run-{RUN_ID}.wandb"
    assert first.steps("loss/train/total") == list(range(BATCHES))
    assert again.steps("loss/train/total") == list(range(SAVED_AT, BATCHES))
    _check(before, _held(first), [0, 2, 4, 6, 8])
    _check(after, _held(again), [6, 8])
    # a new folder: W&B's new run, the JSONL's one attempt
    [fresh] = _attempts(run_folder(tmp_path, "new"))
    [new] = wandb_history.read_runs(run_folder(tmp_path, "new"), wait=120)
    assert new.steps("loss/train/total") == list(range(SAVED_AT, BATCHES))
    _check(fresh, _held(new), [6, 8])
    # resume is exact: the resumed steps hold the uninterrupted run's values
    for resumed in (after, fresh):
        assert [k for k, v in resumed.items() if not _same(before[k], v)] == []
