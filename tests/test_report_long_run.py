"""A long, wide run read for the report (QA s20: an MPT-1B-sized run, 96 layers x 3 tensors
logged every 10 of 50k steps over three W&B attempts, held every history row of every attempt
as dicts (503 MB at 5k steps) and read the run's files a second time for `--baseline`'s config
check): the work is counted here, not timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2 as pb
from wandb.sdk.internal.datastore import DataStore

import foundry_fp8.wandb_history as wandb_history
from foundry_fp8.cli import main
from foundry_fp8.health import Thresholds, collect, history, layer_key
from foundry_fp8.health.keys import HIGH_PRECISION
from foundry_fp8.jsonl import JsonlSink

GROWING = "blocks.1.ffn.down_proj"  # its gradient's underflow grows slowly from step 300
LAYERS = ("blocks.0.attn.Wqkv", GROWING)
INTERVAL = 10


def underflow(step: int) -> float:
    return 3.0 + max(0, step - 300) * 0.01  # never doubles in a few steps: no underflow_rising


def row(step: int) -> dict[str, float]:
    values = {"loss/train/total": 3.0, "_step": step}
    for layer in LAYERS:
        for tensor in ("activation", "weight", "gradient"):
            grows = layer == GROWING and tensor == "gradient"
            values |= {layer_key("underflow_pct", tensor, layer): underflow(step) if grows else 0.3,
                       layer_key("cos_sim", tensor, layer): 0.9995,
                       layer_key("scale_ratio", tensor, layer): 1.0,
                       layer_key("amax", tensor, layer): 2.0}
    return values


def attempt(folder: Path, name: str, steps: range, config: dict, finished: bool) -> Path:
    """One attempt's `.wandb` file written with W&B's own writer, in W&B's record layout (one
    history row a step, a `_step` item, config records, an exit record when finished)."""
    (folder / name).mkdir(parents=True)
    path = folder / name / "run-long.wandb"
    store = DataStore()
    store.open_for_write(str(path))
    record = pb.Record()
    for key, value in config.items():
        item = record.config.update.add()
        item.key, item.value_json = key, json.dumps(value)
    store.write(record)
    for step in steps:
        record = pb.Record()
        record.history.step.num = step
        for key, value in row(step).items():
            item = record.history.item.add()
            item.nested_key.append(key)
            item.value_json = json.dumps(value)
        store.write(record)
    if finished:
        record = pb.Record()
        record.exit.runtime = 1
        store.write(record)
    store.close()
    return path


@pytest.fixture
def wandb_run(tmp_path):
    """Three attempts: killed after step 250 (resumed from 200), killed after 400 with rows up
    to 340 lost (resumed from 400: a gap in the history), then to step 600."""
    folder = tmp_path / "fp8" / "wandb"
    config = {"seed": 17, "callbacks": {"fp8_stats": {"interval": "10ba"}}}
    return [attempt(folder, f"offline-run-2026110{n}_120000-long", steps, config, finished)
            for n, steps, finished in ((1, range(0, 251, INTERVAL), False),
                                       (2, range(200, 341, INTERVAL), False),
                                       (3, range(400, 601, INTERVAL), True))]


def test_each_attempts_file_is_read_once_with_a_baseline(wandb_run, tmp_path, monkeypatch,
                                                          capsys):
    opened: list[Path] = []
    records = wandb_history._records
    monkeypatch.setattr(wandb_history, "_records",
                        lambda run: opened.append(Path(run.path)) or records(run))
    base = tmp_path / "bf16"
    sink = JsonlSink(base / "metrics.jsonl")
    for step in range(0, 601, INTERVAL):
        sink.write(step, {"loss/train/total": 3.0})
    (base / "hparams.json").write_text(json.dumps({"seed": 17}))
    assert main(["report", str(tmp_path / "fp8"), "--baseline", str(base),
                 "--out", str(tmp_path / "out")]) == 0
    assert sorted(opened) == sorted(wandb_run)  # not a second read for the config check
    capsys.readouterr()


def test_the_slowly_growing_layer_is_flagged_where_it_crossed_the_limit(wandb_run, tmp_path,
                                                                         capsys):
    limit = Thresholds().max_underflow_pct
    kept = [*range(0, 200, INTERVAL), *range(200, 341, INTERVAL), *range(400, 601, INTERVAL)]
    crossed = next(step for step in kept if underflow(step) > limit)
    assert crossed == 510  # 3 + 210 * 0.01 = 5.1 > 5; at 500, 5.0
    assert main(["report", str(tmp_path / "fp8"), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr()
    flagged = [line for line in (tmp_path / "out" / "fp8_report.md").read_text().splitlines()
               if line.startswith(f"| {GROWING} | gradient | underflow_pct")]
    assert len(flagged) == 1 and f"| {crossed} | {len(kept) - kept.index(crossed)} of" in (
        flagged[0]), flagged
    assert "steps go back once (step 250 -> 200)" in out.err
    assert "1 flagged" in out.out  # the gap after step 340 is no fault


def test_worst_cells_of_a_run_without_fp8_guard_read_no_series(monkeypatch):
    """`whatif_worst` asks which worst values only fp8_guard's what-if numbers reached: with no
    row ever in high precision there is none, and no series needs reading (it read each one
    in full, twice a report)."""
    run = collect((step, row(step)) for step in range(0, 101, INTERVAL))
    points: list[str] = []
    worst_point = history.worst_point
    monkeypatch.setattr(history, "worst_point",
                        lambda stat, by_step: points.append(stat) or worst_point(stat, by_step))
    assert history.whatif_worst(run) == set()
    assert points == []
    run.add(50, GROWING, "gradient", HIGH_PRECISION, 1.0)  # what-if numbers at one step
    assert history.whatif_worst(run) == set() and points
