"""Runs an older foundry-fp8 began and this one reads (QA U20): the fixtures copy the minimal
shape of real files a build at aaffc1b (2026-11-26: fp8_guard's series without
`fp8/guard/in_fallback/<layer>`) and one at 4e18ea9 (2026-11-22: per-layer keys
`fp8/<layer>/<tensor>/<stat>`, logged to W&B a step behind, which W&B 0.18.7's service dropped,
saying so in the attempt's logs/debug-internal.log) wrote."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from foundry_fp8.cli import main
from foundry_fp8.guard import FALLBACK_PREFIX, Fallback
from foundry_fp8.report.cli import make_report

LAYER, OTHER = "blocks.1.attn.out_proj", "blocks.0.attn.Wqkv"
DECIDED = 15  # the step fp8_guard's record says it moved LAYER (aaffc1b's part of the run)
UPGRADED = 20  # the first step the current build logged


def _stats(step: int, underflow: float | None = None) -> dict[str, float]:
    """fp8_stats' per-layer series at `step`; LAYER's activation underflow `underflow` where
    given."""
    stats = {f"fp8_{stat}/{tensor}/{layer}": value
             for layer in (LAYER, OTHER) for tensor in ("activation", "weight")
             for stat, value in (("underflow_pct", 0.1 + step / 100), ("cos_sim", 0.9996))}
    if underflow is not None:
        stats[f"fp8_underflow_pct/activation/{LAYER}"] = underflow
    return stats


def _write_jsonl(path: Path, rows: list[tuple[int, dict[str, Any]]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": s, "metrics": m}) + "\n" for s, m in rows))


def test_a_fallback_decided_before_an_upgrade_keeps_its_records_step(tmp_path, capsys):
    """aaffc1b logged `fp8/guard/fallback_layers` alone (steps 0-15, the fallback decided at
    15); the current build, resumed from the step-20 checkpoint, logs
    `fp8/guard/in_fallback/<layer>` too. A missing key was read as 0 from step 0: "from step
    21", "no record in the hyperparameters", the step-20 row not hatched."""
    rows = []
    for step in range(0, 40, 5):
        guard = {"fp8/guard/fallback_layers": float(step >= DECIDED),
                 "fp8/guard/fp8_flops_share": 0.71875 if step >= DECIDED else 0.75}
        if step >= UPGRADED:
            guard[f"fp8/guard/in_fallback/{LAYER}"] = 1.0
        rows.append((step, {**_stats(step), **guard}))
    _write_jsonl(tmp_path / "metrics.jsonl", rows)
    record = Fallback(LAYER, DECIDED, 0.03125, ("activation underflow_pct 24.3 % (> 5 %)",),
                      flagged=("activation underflow_pct 24.3 % (> 5 %)",)).record()
    (tmp_path / "hparams.json").write_text(json.dumps({
        "callbacks": {"fp8_stats": {"interval": "5ba"},
                      "fp8_guard": {"consecutive": 2, "repromote_after": 2}},
        FALLBACK_PREFIX + LAYER: record}))
    run, _, guard, _, _ = make_report(tmp_path, out=tmp_path / "out")
    assert guard is not None
    assert [Fallback.from_dict(record)] == guard.fallbacks  # was step 20, "no record ..."
    assert guard.spans() == [(LAYER, DECIDED, None)]
    hatched = sorted(s for layer, tensor, s in run.high_precision
                     if (layer, tensor) == (LAYER, "activation"))
    assert hatched == [s for s in range(0, 40, 5) if s > DECIDED]  # was 25-35: 20 missing
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert f"{LAYER} from step {DECIDED + 1}." in capsys.readouterr().out


#: Two lines W&B 0.18.7's service wrote in an attempt's logs/debug-internal.log (U20, r2).
DROPPED = ('{"time":"2026-11-29T20:20:18.8986282Z","level":"WARN","msg":"handler: ignoring '
           'partial history record","step":%d,"current":%d}\n')


def _wandb_attempt(folder: Path, steps: range, config: dict[str, Any], stats: bool,
                   dropped: list[int], finished: bool = True, underflow: float | None = None,
                   extra: dict[str, float] | None = None) -> Path:
    """An attempt as W&B leaves it: `run-<id>.wandb` (a config, a history row per step, with
    fp8_stats' series where `stats`, the exit record where `finished`) and its own log."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    path = folder / f"run-{folder.name.rpartition('-')[2]}.wandb"
    (folder / "logs").mkdir(parents=True)
    (folder / "logs" / "debug-internal.log").write_text(
        '{"time":"2026-11-29T20:20:10Z","level":"INFO","msg":"stream: starting"}\n'
        + "".join(DROPPED % (s, s + 1) for s in dropped))
    store = DataStore()
    store.open_for_write(str(path))
    record = wandb_internal_pb2.Record()
    for key, value in config.items():
        record.config.update.add(key=key, value_json=json.dumps(value))
    store.write(record)
    for step in steps:
        record = wandb_internal_pb2.Record()
        record.history.step.num = step
        row = {"loss/train/total": 2.5, **(_stats(step, underflow) if stats and step % 5 == 0 else {}),
               **(extra if extra and step % 5 == 0 else {})}
        for key, value in {**row, "_step": step}.items():
            record.history.item.add(key=key, value_json=json.dumps(value))
        store.write(record)
    if finished:
        record = wandb_internal_pb2.Record()
        record.exit.exit_code = 0
        store.write(record)
    store.close()
    return path


CONFIG = {"run_name": "o2full", "callbacks": {"fp8_stats": {"interval": "5ba"}},
          "loggers": {"jsonl": {"path": "metrics.jsonl"}}}


def test_a_wandb_run_whose_fp8_rows_w_and_b_dropped_says_so(tmp_path, capsys):
    """4e18ea9's W&B run holds no FP8 series at all: W&B dropped each row fp8_stats logged a
    step behind. The report said "metrics.jsonl: not found; the run's is in <folder above>",
    another run's file there, or "add `loggers: {jsonl: {}}`" (it had one)."""
    _write_jsonl(tmp_path / "metrics.jsonl", [(20, _stats(20))])  # another run's, in the cwd
    wandb_dir = tmp_path / "oldfull" / "wandb"
    attempt = wandb_dir / "offline-run-20261129_202010-o2full"
    run_file = _wandb_attempt(attempt, range(40), CONFIG, False, [0, 5, 10, 15, 20, 25, 30, 35])
    for given in (wandb_dir, run_file):
        assert main(["report", str(given), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"error: {given}: no FP8 statistics reached W&B: {run_file}: W&B "
                              "dropped the history rows of 8 step(s), 0, 5, 10, 15, 20, 25, 30, "
                              "35 (its offline-run-20261129_202010-o2full/logs/"
                              "debug-internal.log"), err
        assert "loggers.jsonl.path: 'metrics.jsonl'" in err and "0b6e716" in err
        assert f"report {tmp_path}" not in err  # not the other run's file


def test_a_wandb_run_upgraded_mid_run_names_the_steps_w_and_b_dropped(tmp_path, capsys):
    """4e18ea9's attempt (killed at step 17, its FP8 rows 0-15 dropped by W&B) resumed by the
    current build from step 20: "4 logging steps (20 to 35)", "0 flagged", no warning."""
    wandb_dir = tmp_path / "mixed" / "wandb"
    _wandb_attempt(wandb_dir / "offline-run-20261129_202033-o2mixed", range(18), CONFIG, False,
                   [0, 5, 10, 15], finished=False)
    _wandb_attempt(wandb_dir / "offline-run-20261129_202235-o2mixed", range(20, 40), CONFIG,
                   True, [])
    assert main(["report", str(wandb_dir), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "W&B dropped the history rows of 4 step(s), 0, 5, 10, 15 " in err, err
    assert "the report covers the steps W&B kept, 20 to 35" in err, err


def test_a_fifo_for_w_and_b_s_log_does_not_block_the_report(tmp_path, capsys):
    """F2-20: the report opened an attempt's logs/debug-internal.log whatever stood there: a FIFO
    blocked `foundry-fp8 report` forever. It reads as the same run with no log at all."""
    wandb_dir = tmp_path / "wandb"
    attempt = wandb_dir / "offline-run-20261129_213000-fifo1"
    _wandb_attempt(attempt, range(20), CONFIG, True, [])
    log = attempt / "logs" / "debug-internal.log"
    log.unlink()
    argv = ["report", str(wandb_dir), "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    without = capsys.readouterr()
    os.mkfifo(log)
    codes: list[int] = []
    report = threading.Thread(target=lambda: codes.append(main(argv)), daemon=True)
    report.start()
    report.join(timeout=300)  # a hang guard, not a timing: it fails rather than hangs
    blocked = report.is_alive()
    if blocked:  # waiting in open() for a writer: be one, and let it finish
        os.close(os.open(log, os.O_WRONLY | os.O_NONBLOCK))
        report.join()
    assert not blocked and codes == [0]
    assert capsys.readouterr() == without


def test_a_metrics_file_in_both_key_layouts_names_the_steps_not_read(tmp_path, capsys):
    """A jsonl file 4e18ea9 began (`fp8/<layer>/<tensor>/<stat>`) and the current build went on
    writing: the older steps were left out without a word."""
    older = {f"fp8/model.transformer.{LAYER}/activation/underflow_pct": 30.0}
    _write_jsonl(tmp_path / "metrics.jsonl",
                 [(0, older), (5, older), (10, _stats(10)), (15, _stats(15))])
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert (f"e.g. `fp8/model.transformer.{LAYER}/activation/underflow_pct`, from foundry-fp8 "
            "builds before 2026-11-23) at 2 logging step(s), 0 to 5, are not read") in err, err
    assert "steps 10 to 15" in err and "0b6e716" in err


def test_a_killed_attempt_a_later_one_follows_names_its_last_step(tmp_path, capsys):
    """U20 r1: the first attempt, killed, reached W&B up to step 14 (its rows 15-19, the
    fallback's step among them, never written); the resumed one logs from 20. A single
    attempt's report warned of a missing exit record, the W&B report of both said nothing."""
    wandb_dir = tmp_path / "wandb"
    killed = _wandb_attempt(wandb_dir / "offline-run-20261129_200830-mixed1", range(15),
                            CONFIG, True, [], finished=False)
    _wandb_attempt(wandb_dir / "offline-run-20261129_201057-mixed1", range(20, 40), CONFIG,
                   True, [])
    assert main(["report", str(wandb_dir), "--out", str(tmp_path / "out")]) == 0
    assert (f"warning: {killed}: no exit record, and a later attempt follows: killed; W&B holds "
            "its rows up to step 14, the next attempt logs from step 20; steps 15 to 19 are in "
            "no attempt's W&B file") in capsys.readouterr().err


def test_a_wandb_report_names_its_thresholds_source_and_the_runs_dump(tmp_path, capsys):
    """U20 r3: the W&B report said "Thresholds from the run's fp8_stats settings (hparams.json)"
    (they came from W&B's config) and never named fp8_stats' dump, which the report of the same
    run's metrics.jsonl names: it looked in the W&B folder, not the run folder holding it."""
    config = {"callbacks": {"fp8_stats": {"interval": "5ba", "max_underflow_pct": 3.0,
                                          "dump_steps": [0]}}}
    wandb_dir = tmp_path / "run" / "wandb"
    _wandb_attempt(wandb_dir / "offline-run-20261129_202825-dump1", range(16), config, True, [],
                   underflow=4.0)  # flagged under the run's 3 %, not the default 5 %
    dump = tmp_path / "run" / "fp8_dumps" / "step0000000-rank0.safetensors"
    dump.parent.mkdir()
    header = json.dumps({f"{LAYER}/activation": {"dtype": "F32", "shape": [1],
                                                 "data_offsets": [0, 4]}}).encode()
    dump.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))  # safetensors
    out = tmp_path / "out"
    assert main(["report", str(wandb_dir), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert (f"First flagged at step 0: '{LAYER}' activation underflow_pct 4 %" in said
            and f"fp8_stats' dump of '{LAYER}' activation there: {dump}." in said), said
    assert "Thresholds from the run's fp8_stats settings (the W&B run's config): underflow > 3 %" \
        in (out / "fp8_report.md").read_text()


def test_a_fallback_whose_rows_w_and_b_lost_keeps_its_records_step(tmp_path):
    """U20 r1 in W&B: aaffc1b's attempt, killed, reached W&B up to step 14, the fallback's
    step 15 lost; the resumed attempt logs `in_fallback` from 20. Its record (in both
    attempts' config) says 15; the report said 20 ("from step 21")."""
    record = Fallback(LAYER, DECIDED, 0.03125, ("activation underflow_pct 24.3 % (> 5 %)",))
    config = {"callbacks": {"fp8_stats": {"interval": "5ba"}, "fp8_guard": {}},
              FALLBACK_PREFIX + LAYER: record.record()}
    wandb_dir = tmp_path / "wandb"
    _wandb_attempt(wandb_dir / "offline-run-20261129_200830-mixed1", range(15), config, True, [],
                   finished=False, extra={"fp8/guard/fallback_layers": 0.0})
    _wandb_attempt(wandb_dir / "offline-run-20261129_201057-mixed1", range(20, 40), config, True,
                   [], extra={"fp8/guard/fallback_layers": 1.0,
                              f"fp8/guard/in_fallback/{LAYER}": 1.0})
    _, _, guard, _, _ = make_report(wandb_dir, out=tmp_path / "out")
    assert guard is not None and guard.spans() == [(LAYER, DECIDED, None)]  # was 20
    assert guard.fallbacks == [record]
