"""`foundry-fp8 report` of an MLflow run at a real run's size: MLflow's client hands back every
point as a Metric object, and the report held them all as tuples of Python numbers, then every
step's record as a dict, before reading the first one: some 240 bytes a point, 4 GB for an
MPT-1B run's 18 million (benchmarks/report_scale.py). It now holds them as arrays and builds
one record at a time. Memory is counted with tracemalloc (deterministic), not timed."""

from __future__ import annotations

import tracemalloc

import pytest

from foundry_fp8.health import collect
from foundry_fp8.health.keys import layer_key, summary_key

mlflow = pytest.importorskip("mlflow")

LAYERS = [f"blocks.{b}.{part}" for b in range(2) for part in ("attn.Wqkv", "ffn.up_proj")]
STATS = ("underflow_pct", "cos_sim", "amax", "scale", "scale_ratio")
TENSORS = ("activation", "weight", "gradient")
STEPS = range(0, 300, 2)


def _records() -> dict[int, dict[str, float]]:
    """What fp8_stats logs at each logging step (its keys, `health.keys`), values that differ."""
    return {step: {**{layer_key(stat, tensor, layer): 1.0 + step / 1000 + i / 7
                      for i, (stat, tensor, layer) in enumerate(
                          (s, t, la) for s in STATS for t in TENSORS for la in LAYERS)},
                   summary_key(None, "flagged_layers"): 0.0}
            for step in STEPS}


def test_an_mlflow_runs_points_are_held_as_arrays_and_read_back_the_same(tmp_path):
    """The numbers read back are those logged (with MLflow's own writer), and reading them holds
    well under 100 bytes a point over what the run's numbers themselves take (the old reader's
    tuples and per-step dicts: about 300)."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from foundry_fp8.report.mlflow_run import load_mlflow, mlflow_run

    client = MlflowClient(tracking_uri=f"file://{tmp_path}/mlruns")
    run_id = client.create_run(client.create_experiment("fp8")).info.run_id
    records = _records()
    for n, (step, metrics) in enumerate(records.items()):
        client.log_batch(run_id, [Metric(key, value, 1_700_000_000_000 + n, step)
                                  for key, value in metrics.items()])
    client.set_terminated(run_id)
    [meta] = (tmp_path / "mlruns").glob("*/*/meta.yaml")
    ml = mlflow_run(meta.parent)
    assert ml is not None
    load_mlflow(ml, print)  # MLflow's imports and caches, paid before counting
    points = sum(map(len, records.values()))
    tracemalloc.start()
    try:
        run, _, _ = load_mlflow(ml, print)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    expected = collect(sorted(records.items()))
    assert run.values == expected.values
    assert run.steps == list(STEPS)
    assert (peak - held) / points < 100, f"{(peak - held) / points:.0f} bytes a point"
