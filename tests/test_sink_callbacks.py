"""Every FP8 value the JSONL holds is in W&B's history and in MLflow at the same step, in a run
shaped like a user's: the tiny MPT through LLM-Foundry's `train` with Composer's usual callbacks
all at once, eval first and every few batches, gradient accumulation, `max_duration` in tokens,
an fp8_stats interval that does not divide the run (its last batch a logging step), and three
loggers. Read back at the sinks: the `.wandb` file with W&B's own reader, MLflow with its
client. (The original complaint: fp8_stats reached the JSONL, not W&B, which drops a step
lower than one it has seen.)"""

from __future__ import annotations

import math

import pytest

from foundry_fp8 import wandb_history
from foundry_fp8.jsonl import read_jsonl
from tests.tiny_run import run_folder, run_tiny

mlflow = pytest.importorskip("mlflow")

TOKENS_PER_BATCH = 8 * 64  # global_train_batch_size x max_seq_len of the tiny YAML
BATCHES = 13
INTERVAL = 3  # logs at 0, 3, ..., 12: the last batch


def _fp8(metrics: dict) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("fp8") and isinstance(v, float | int)}


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.slow
def test_every_fp8_value_of_the_jsonl_is_in_wandb_and_mlflow_at_its_step(tmp_path, tiny_data,
                                                                          monkeypatch):
    from mlflow.tracking import MlflowClient

    # MLflow's file store races creating a metric's folder from its async threads and drops
    # that batch now and then ('[Errno 17] File exists', docs/fp8_stats.md): one thread here
    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE", "1")

    name = "callbacks"
    tracking = f"file://{tmp_path}/mlruns"
    overrides = {
        "variables": {"run_name": name}, "max_duration": f"{BATCHES * TOKENS_PER_BATCH}tok",
        "scheduler": {"t_warmup": f"{2 * TOKENS_PER_BATCH}tok"},  # the duration's unit
        "eval_interval": "4ba", "eval_first": True, "eval_subset_num_batches": 1,
        "device_train_microbatch_size": 2, "console_log_interval": "1ba",
        "save_interval": "100ba",
        "callbacks": {
            "speed_monitor": {"window_size": 2}, "lr_monitor": {}, "memory_monitor": {},
            "runtime_estimator": {},
            "optimizer_monitor": {"log_optimizer_metrics": True, "batch_log_interval": 1},
            "hf_checkpointer": {"save_folder": str(tmp_path / "hf"), "save_interval": "6ba"},
            "generate_callback": {"prompts": ["the cat"], "interval": "5ba", "batch_size": 1,
                                  "max_new_tokens": 2, "do_sample": False},
            "fp8_stats": {"interval": f"{INTERVAL}ba", "image_interval": "6ba"}},
        # Composer's MLflow logger skips a value equal to the key's last within
        # log_duplicated_metric_every_n_steps steps (default 100): 0 keeps every point
        "loggers": {"mlflow": {"tracking_uri": tracking, "experiment_name": name,
                               "log_duplicated_metric_every_n_steps": 0}},
    }
    run_tiny(tmp_path, tiny_data, overrides, wandb=True).close()

    folder = run_folder(tmp_path, name)
    jsonl: dict[tuple[str, int], float] = {}
    for step, metrics in read_jsonl(folder / "metrics.jsonl"):
        jsonl.update({(k, step): v for k, v in _fp8(metrics).items()})
    steps = list(range(0, BATCHES, INTERVAL))
    assert sorted({s for _, s in jsonl}) == steps == [0, 3, 6, 9, 12]

    [run] = wandb_history.read_runs(folder, wait=120)
    # W&B's own log of the rows it dropped (a step lower than one it has seen); W&B says
    # nothing of them on the console, and the .wandb file holds no trace of them
    assert wandb_history.dropped_steps(run.path) == []
    assert run.complete and run.steps("loss/train/total") == list(range(BATCHES))
    wandb = {(k, row["_step"]): v for row in run.rows for k, v in _fp8(row).items()}

    client = MlflowClient(tracking_uri=tracking)
    [experiment] = [e for e in client.search_experiments() if e.name == name]
    [mlrun] = client.search_runs([experiment.experiment_id])
    mlflow_values = {(k, m.step): m.value for k in mlrun.data.metrics if k.startswith("fp8")
                     for m in client.get_metric_history(mlrun.info.run_id, k)}

    assert len(jsonl) > 1000  # 8 layers x 3 tensors x 12 statistics + summaries, x 5 steps
    for sink in (wandb, mlflow_values):
        assert sink.keys() == jsonl.keys()
        assert [k for k, v in jsonl.items() if not _same(sink[k], v)] == []
