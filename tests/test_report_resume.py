"""`foundry-fp8 report` on runs that were interrupted and resumed, from the files real runs
wrote: Composer Trainers (te_swap's emulated FP8, fp8_stats, the jsonl logger) killed with
SIGKILL from inside and restarted with `autoresume`, and a Trainer fitted twice with
`reset_time`. The jsonl logger appends every attempt to one metrics.jsonl; the report must keep,
for each step, the numbers of the latest attempt that logged it, and nothing a dead attempt
logged after the checkpoint the next one resumed from. Run as `python -m
tests.test_report_resume FOLDER OPTIONS_JSON` for one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry_fp8 import wandb_history
from foundry_fp8.cli import main
from foundry_fp8.health.keys import parse_key
from foundry_fp8.report.read import load_run, load_wandb, wandb_files

ROOT = Path(__file__).resolve().parents[1]
BATCHES, SAVE_EVERY = 8, 4
SPIKED = "blocks.1"  # the layer whose weight the dead attempt multiplies by 1e4


def _train(folder: Path, options: dict[str, Any]) -> None:
    """One process of the run in `folder`. `options`: `stats` (fp8_stats' options), `kill`
    (SIGKILL as batch N starts), `spike` (the SPIKED weight times 1e4 as batch N starts),
    `refit` (after the fit, fit again for that many batches with `reset_time=True`), `wandb`
    (a W&B offline logger too, this run id), `load` (the checkpoint to resume from)."""
    from composer import Callback, Trainer
    from composer.loggers import LoggerDestination
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.jsonl_logger import JSONLLogger
    from foundry_fp8.composer.state import FP8State
    from foundry_fp8.composer.stats import FP8Stats
    from foundry_fp8.composer.te_swap import TESwap
    from tests.test_state_restore import TwoBlocks

    class Faults(Callback):
        def batch_start(self, state, logger):
            batch = int(state.timestamp.batch)
            if batch == options.get("kill"):
                os.kill(os.getpid(), signal.SIGKILL)
            if batch == options.get("spike"):
                with torch.no_grad():
                    state.model.module.blocks[1].weight.mul_(1e4)

    class Refit(LoggerDestination):
        """What fp8_stats logs during the second fit, step by step (the test's reference)."""

        def __init__(self):
            self.on = False
            self.logged: dict[int, dict[str, float]] = {}

        def log_metrics(self, metrics, step=None):
            if self.on:
                self.logged.setdefault(int(step), {}).update(
                    {k: float(v) for k, v in metrics.items() if parse_key(k)})

    loggers: list[LoggerDestination] = [JSONLLogger(path=str(folder / "metrics.jsonl"))]
    if "wandb" in options:  # W&B offline, every attempt the same run (`resume: allow`)
        from composer.loggers import WandBLogger

        folder.mkdir(parents=True, exist_ok=True)  # W&B writes into `dir` only if it exists
        loggers.append(WandBLogger(project="fp8-report", init_kwargs={
            "mode": "offline", "dir": str(folder), "id": options["wandb"], "resume": "allow",
            "settings": {"allow_offline_artifacts": False}}))
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * BATCHES, 16) * 3, torch.randint(0, 16, (8 * BATCHES,)))
    refit = Refit()
    trainer = Trainer(
        model=ComposerClassifier(TwoBlocks(), num_classes=16), seed=17, run_name="resumed",
        train_dataloader=DataLoader(data, batch_size=8), max_duration=f"{BATCHES}ba",
        algorithms=[TESwap(backend="emulate", fp8_recipe={"amax_history_len": 4})],
        callbacks=[FP8State(), FP8Stats(**options.get("stats", {"interval": 1})), Faults()],
        loggers=[*loggers, refit], device="cpu",
        progress_bar=False, save_folder=str(folder / "checkpoints"),
        save_interval=f"{SAVE_EVERY}ba", save_overwrite="refit" in options,  # saved again
        # Composer's autoresume asks a WandBLogger for the checkpoint: with W&B, `load` it
        autoresume=not {"refit", "wandb"} & options.keys(), load_path=options.get("load"))
    trainer.fit()
    if "refit" in options:
        refit.on = True
        trainer.fit(duration=f"{options['refit']}ba", reset_time=True)
        (folder / "refit.json").write_text(json.dumps(refit.logged))
    trainer.close()


def _attempt(folder: Path, **options: Any) -> subprocess.CompletedProcess:
    from tests.tiny_run import own_wandb_env

    env = own_wandb_env(PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "tests.test_report_resume", str(folder),
                           json.dumps(options)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def _per_layer(lines: list[bytes]) -> dict[int, dict[str, float]]:
    """step -> {per-layer key: value} of JSONL lines, parsed with plain `json` (the last value
    per step and key)."""
    found: dict[int, dict[str, float]] = {}
    for line in lines:
        record = json.loads(line)
        if ours := {k: float(v) for k, v in record["metrics"].items() if parse_key(k)}:
            found.setdefault(record["step"], {}).update(ours)
    return found


def _reported(metrics_file: Path) -> dict[int, dict[str, float]]:
    """step -> {per-layer key: value} as the report reads the file (markers left out)."""
    run, _ = load_run(metrics_file, lambda message: None)
    found: dict[int, dict[str, float]] = {}
    for (layer, tensor, stat), by_step in run.values.items():
        for step, value in by_step.items():
            found.setdefault(step, {})[f"fp8_{stat}/{tensor}/{layer}"] = value
    return found


def _markers_left_out(logged: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    marks = ("fp8_initial_scale/", "fp8_high_precision/", "fp8_uncast/")
    return {step: kept for step, values in logged.items()
            if (kept := {k: v for k, v in values.items() if not k.startswith(marks)})}


@pytest.mark.slow
def test_a_run_resumed_with_other_fp8_stats_settings_is_reported_as_the_resumed_attempt_ran(
        tmp_path, capsys):
    """QA s16: the dead attempt (every batch, both layers, a weight spiked after the checkpoint)
    kept its steps the resumed attempt (every 2nd batch, one layer) did not log again: the
    report flagged the rolled-back spike (overflow_spike at step 5) and drew blocks.0's dead
    steps between its live ones."""
    folder = tmp_path / "run"
    dead = _attempt(folder, kill=7, spike=5)
    assert dead.returncode == -signal.SIGKILL, dead.stderr[-2000:]
    assert "overflow_pct" in dead.stderr  # the dead attempt did warn about its spike
    metrics_file = folder / "metrics.jsonl"
    dead_lines = metrics_file.read_bytes().splitlines()
    resumed = _attempt(folder, stats={"interval": 2, "layers": SPIKED})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "overflow_pct" not in resumed.stderr  # the resumed attempt ran healthy
    live = _per_layer(metrics_file.read_bytes().splitlines()[len(dead_lines):])
    assert min(live) == SAVE_EVERY  # it resumed from the checkpoint of batch 4
    expected = {step: values for step, values in _per_layer(dead_lines).items()
                if step < SAVE_EVERY}
    expected.update(live)
    assert _reported(metrics_file) == _markers_left_out(expected)
    assert sorted(expected) == [0, 1, 2, 3, 4, 6]  # step 5: only the dead attempt logged it
    assert main(["report", str(folder)]) == 0
    out, err = capsys.readouterr()
    assert "\n0 flagged\n" in out, out
    assert err.strip() == (f"warning: {metrics_file}: the steps go back once (step 6 -> 4): a "
                           "resumed run logs the steps after its checkpoint again, fit() again "
                           "with reset_time logs from step 0; from each such step on, the report "
                           "keeps the later attempt's numbers only"), err


@pytest.mark.slow
def test_a_run_resumed_twice_counts_each_step_once_with_its_last_attempts_numbers(tmp_path):
    folder = tmp_path / "run"
    metrics_file = folder / "metrics.jsonl"
    attempts = []
    for kill in (6, 7, None):
        done = _attempt(folder, **({"kill": kill} if kill else {}))
        assert done.returncode == (0 if kill is None else -signal.SIGKILL), done.stderr[-2000:]
        attempts.append(metrics_file.read_bytes().splitlines())
    first, second, third = (_per_layer(attempts[0]),
                            _per_layer(attempts[1][len(attempts[0]):]),
                            _per_layer(attempts[2][len(attempts[1]):]))
    assert (min(second), min(third)) == (SAVE_EVERY, SAVE_EVERY)  # both from batch 4's checkpoint
    expected = {s: v for s, v in first.items() if s < SAVE_EVERY} | third
    assert sorted(expected) == list(range(BATCHES))
    assert _reported(metrics_file) == _markers_left_out(expected)


@pytest.mark.slow
def test_a_second_fit_with_reset_time_is_what_the_report_shows(tmp_path, capsys):
    """`fit()` again with `reset_time=True` logs from step 0 into the same file: the report is
    the second fit's (fp8_stats' numbers as a logger saw them during it), with one warning."""
    folder = tmp_path / "run"
    done = _attempt(folder, refit=3)
    assert done.returncode == 0, done.stderr[-2000:]
    refit = {int(s): v for s, v in json.loads((folder / "refit.json").read_text()).items()}
    assert sorted(refit) == [0, 1, 2, 3]  # and its fit end's summary at step 3
    assert _reported(folder / "metrics.jsonl") == _markers_left_out(refit)
    assert main(["report", str(folder)]) == 0
    assert f"(step {BATCHES} -> 0)" in capsys.readouterr().err


@pytest.mark.slow
def test_a_resumed_wandb_offline_run_is_reported_from_w_and_bs_own_files(tmp_path, capsys):
    """QA s16: `report` refused the `.wandb` files ("W&B's binary run file, not a metrics
    file"). Each attempt of the resumed run (`resume: allow`, one id) writes its own offline
    folder; the report reads them all with W&B's reader, the later attempt's rows winning."""
    folder = tmp_path / "run"
    dead = _attempt(folder, kill=7, spike=5, wandb="resumed")
    assert dead.returncode == -signal.SIGKILL, dead.stderr[-2000:]
    checkpoint = folder / "checkpoints" / f"ep0-ba{SAVE_EVERY}-rank0.pt"
    resumed = _attempt(folder, wandb="resumed", load=str(checkpoint),
                       stats={"interval": 2, "layers": SPIKED})
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    first, second = (
        {row["_step"]: values for row in run.rows
         if (values := {k: float(v) for k, v in row.items() if parse_key(k)})}
        for run in wandb_history.read_runs(folder / "wandb", wait=60))
    assert min(second) == SAVE_EVERY
    expected = {step: values for step, values in first.items() if step < SAVE_EVERY} | second
    # W&B's folder, or the link to the last attempt's folder in it: every attempt either way
    for given in (folder / "wandb", folder / "wandb" / "latest-run"):
        assert main(["report", str(given), "--out", str(tmp_path / "out")]) == 0
        assert "\n0 flagged\n" in capsys.readouterr().out
        run, _, _ = load_wandb(given, wandb_files(given), lambda message: None)
        assert {step: {f"fp8_{stat}/{tensor}/{layer}": by_step[step]
                       for (layer, tensor, stat), by_step in run.values.items() if step in by_step}
                for step in run.steps} == _markers_left_out(expected)


if __name__ == "__main__":
    _train(Path(sys.argv[1]), json.loads(sys.argv[2]))


def _wandb_attempt(path: Path, steps: range, config: dict[str, Any],
                   underflow: float = 0.1) -> None:
    """An attempt's `.wandb` file as W&B's writer leaves it: its config, then one history row
    per step (an `underflow` series and fp8_guard's count)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    path.parent.mkdir(parents=True)
    store = DataStore()
    store.open_for_write(str(path))
    record = wandb_internal_pb2.Record()
    for key, value in config.items():
        record.config.update.add(key=key, value_json=json.dumps(value))
    store.write(record)
    for step in steps:
        record = wandb_internal_pb2.Record()
        record.history.step.num = step
        for key, value in {"fp8_underflow_pct/weight/blocks.0.fc": underflow,
                           "fp8/guard/fallback_layers": 1.0, "_step": step}.items():
            record.history.item.add(key=key, value_json=json.dumps(value))
        store.write(record)
    store.close()


def test_a_dead_attempts_fallback_after_the_checkpoint_is_not_the_resumed_wandb_runs(tmp_path):
    """The attempts' W&B configs were merged whole: a fallback only the killed attempt decided,
    after the checkpoint the run resumed from, was reported as the run's (a layer the live run
    kept in FP8 named in high precision, its cells hatched). A restored fallback stays."""
    from foundry_fp8.guard import FALLBACK_PREFIX, Fallback
    from foundry_fp8.report.cli import make_report

    restored, dead = (Fallback(layer, step, 0.25, ("underflow",)).record()
                      for layer, step in (("blocks.0.fc", 2), ("blocks.1.fc", 6)))
    callbacks = {"callbacks": {"fp8_stats": {}, "fp8_guard": {}}}
    wandb_dir = tmp_path / "wandb"
    _wandb_attempt(wandb_dir / "offline-run-20261129_010000-abc" / "run-abc.wandb", range(8),
                   {**callbacks, FALLBACK_PREFIX + "blocks.0.fc": restored,
                    FALLBACK_PREFIX + "blocks.1.fc": dead})
    _wandb_attempt(wandb_dir / "offline-run-20261129_020000-abc" / "run-abc.wandb", range(4, 10),
                   {**callbacks, FALLBACK_PREFIX + "blocks.0.fc": restored})
    _, _, guard, _, _ = make_report(wandb_dir, out=tmp_path / "out")
    assert guard is not None
    assert [(f.layer, f.step) for f in guard.fallbacks] == [("blocks.0.fc", 2)]


def test_a_copied_wandb_file_outside_w_and_bs_folders_is_reported_from_itself(tmp_path):
    """Review s16: `report copy/run-abc.wandb` said "W&B's binary run file, not a metrics file"
    (the attempts' glob found none outside `wandb/offline-run-*`)."""
    copy = tmp_path / "copy" / "run-abc.wandb"
    _wandb_attempt(copy, range(4), {"callbacks": {"fp8_stats": {}}})
    assert wandb_files(copy) == [copy]
    assert main(["report", str(copy), "--out", str(tmp_path / "out")]) == 0


def test_an_online_attempt_then_an_offline_resume_are_read_in_time_order(tmp_path):
    """Review 19: attempts were sorted by folder name, and every `offline-run-` folder sorts
    before every `run-` one: an online first attempt (killed at step 7) resumed offline from
    step 4 was read newest first, the killed attempt's numbers winning from step 4 and steps
    "going back" 9 -> 0. W&B names both `{run_mode}-{%Y%m%d_%H%M%S}-{id}`: time order."""
    wandb_dir = tmp_path / "wandb"
    online = wandb_dir / "run-20261129_090000-abc" / "run-abc.wandb"
    offline = wandb_dir / "offline-run-20261129_100000-abc" / "run-abc.wandb"
    earlier = wandb_dir / "offline-run-20261128_230000-abc" / "run-abc.wandb"
    config = {"callbacks": {"fp8_stats": {}}}
    _wandb_attempt(earlier, range(0), config)  # an attempt the day before, killed before a row
    _wandb_attempt(online, range(8), config, underflow=5.0)
    _wandb_attempt(offline, range(4, 10), config, underflow=0.25)
    assert wandb_files(wandb_dir) == [earlier, online, offline]
    said: list[str] = []
    run, _, _ = load_wandb(wandb_dir, wandb_files(wandb_dir), said.append)
    assert run.steps == list(range(10))
    assert run.values[("blocks.0.fc", "weight", "underflow_pct")] == {
        step: 5.0 if step < 4 else 0.25 for step in range(10)}
    assert "go back once (step 7 -> 4)" in said[0] and said[3].startswith(f"{offline}: no exit")
    assert said[1:3] == [  # each killed attempt a later one follows (D3-20)
        f"{earlier}: no exit record, and a later attempt follows: killed; W&B holds no history "
        "row, the next attempt logs from step 0",
        f"{online}: no exit record, and a later attempt follows: killed; W&B holds its rows up to "
        "step 7, the next attempt logs from step 4"]
