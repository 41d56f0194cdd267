"""What reaches W&B, checked where the user looks: a real tiny LLM-Foundry training with
Composer's `WandBLogger` (offline), its `.wandb` file read back with W&B's own reader
(`foundry_fp8.wandb_history`), never "the logger was called" or "the folder exists"; and
what Composer's console printed."""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import time
from collections.abc import Iterable, Iterator, Sequence

import pytest
import torch
from composer.core import Callback
from composer.loggers import LoggerDestination

from foundry_fp8 import wandb_history
from foundry_fp8.composer.guard import FALLBACK_LAYERS, FP8_FLOPS_SHARE, FP8Guard
from foundry_fp8.composer.stats import IMAGE_PREFIX, TABLE_NAME
from foundry_fp8.fault import InjectOutlier
from foundry_fp8.health import INITIAL_SCALE, SUMMARIES, TENSORS, layer_key, summary_key
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.numerics import STAT_KEYS
from tests.tiny_run import run_folder, run_tiny

INTERVAL = 2
IMAGE_INTERVAL = 4
BATCHES = 12
RESUME_AT = 8
BROKEN_AT = 10
BROKEN = "blocks.1.attn.Wqkv"
LAYERS = [f"blocks.{b}.{linear}" for b in (0, 1)
          for linear in ("attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj")]
LAYER_KEYS = {layer_key(stat, tensor, layer) for layer in LAYERS for tensor in TENSORS
              for stat in STAT_KEYS}
SUMMARY_KEYS = {summary_key(t, name) for t in TENSORS for name in SUMMARIES} | {
    summary_key(None, "flagged_layers")}


def _steps_of(key: str, steps: list[int]) -> list[int]:
    """The logging steps that hold `key`: a worst_* summary none at step 0, where delayed
    scaling's first cast (the initial scale) leaves no layer to count."""
    return [s for s in steps if s != 0 or "/worst_" not in key]


def _overrides(run_name: str, **extra) -> dict:
    return {"variables": {"run_name": run_name}, "max_duration": f"{BATCHES}ba",
            "save_interval": f"{RESUME_AT}ba", "eval_interval": f"{BATCHES}ba",
            "console_log_interval": f"{INTERVAL}ba",
            "callbacks": {"fp8_stats": {"interval": f"{INTERVAL}ba",
                                        "image_interval": f"{IMAGE_INTERVAL}ba"}}, **extra}


def _logging_steps(run: wandb_history.WandbRun) -> list[int]:
    """The steps of Composer's own `loss/train/total` rows at fp8_stats' logging batches: where
    a user lines the FP8 statistics up with the loss."""
    return [step for step in run.steps("loss/train/total") if step % INTERVAL == 0]


class _BreakWeight(Callback):
    """Scales one layer's weight x1e4 just before batch BROKEN_AT's forward."""

    def batch_start(self, state, logger) -> None:
        if int(state.timestamp.batch) == BROKEN_AT:
            module = dict(state.model.named_modules())[f"model.transformer.{BROKEN}"]
            with torch.no_grad():
                module.weight.mul_(1e4)


@contextlib.contextmanager
def added_to_trainer(callbacks: Sequence[Callback] = (),
           loggers: Sequence[LoggerDestination] = ()) -> Iterator[None]:
    """LLM-Foundry's train() builds the Trainer itself: add callbacks after its own, and
    logger destinations before its own."""
    train_module = importlib.import_module("llmfoundry.command_utils.train")
    original = train_module.Trainer

    def trainer(*args, **kwargs):
        kwargs["callbacks"] = [*kwargs.get("callbacks", []), *callbacks]
        kwargs["loggers"] = [*loggers, *kwargs.get("loggers", [])]
        return original(*args, **kwargs)

    train_module.Trainer = trainer
    try:
        yield
    finally:
        train_module.Trainer = original


@pytest.mark.slow
def test_what_fp8_stats_logs_reaches_wandb_at_the_loss_steps_also_after_a_resume(
        tmp_path, tiny_data, capfd):
    # LLM-Foundry's train() leaves the Trainer open (the CLI closes it at exit); closing it
    # finishes the W&B run, whose service writes the last rows
    run_tiny(tmp_path, tiny_data, _overrides("full"), wandb=True).close()
    console = capfd.readouterr()
    [run] = wandb_history.read_runs(run_folder(tmp_path, "full"), wait=120)
    assert run.complete
    assert run.steps("loss/train/total") == list(range(BATCHES))
    steps = _logging_steps(run)
    assert steps == [0, 2, 4, 6, 8, 10]
    for key in sorted(LAYER_KEYS | SUMMARY_KEYS):
        assert run.steps(key) == _steps_of(key, steps), key
    # te_swap's emulated layers run delayed scaling: step 0 casts with the initial scale
    initial = {layer_key(INITIAL_SCALE, t, layer) for layer in LAYERS for t in TENSORS}
    for key in initial:
        assert run.steps(key) == [0], key
    media = {*run.media("images/separated"), *run.media("table-file")}
    assert {k for k in run.keys() if k.startswith("fp8")} - media == \
        LAYER_KEYS | SUMMARY_KEYS | initial
    # the healthy tiny run: nothing flagged, at any step
    assert all(row[summary_key(None, "flagged_layers")] == 0 for row in run.rows
               if summary_key(None, "flagged_layers") in row)
    # heatmaps and table every IMAGE_INTERVAL batches, and at fit end (step 12, for step 10)
    images = run.media("images/separated")
    assert {f"{IMAGE_PREFIX}{s}" for s in ("underflow_pct", "overflow_pct", "cos_sim")} <= \
        images.keys()
    assert all(at == [4, 8, 12] for at in images.values()), images
    assert run.media("table-file") == {TABLE_NAME: [4, 8, 12]}
    columns, rows = run.table(TABLE_NAME, 8)
    assert len(rows) == len(LAYERS) * len(TENSORS)
    row_8 = next(r for r in rows if r[1:3] == [BROKEN, "weight"])
    at_8 = next(r for r in run.rows if r["_step"] == 8 and layer_key("amax", "weight", BROKEN) in r)
    assert row_8[columns.index("amax")] == at_8[layer_key("amax", "weight", BROKEN)]
    # Composer's console: the summary series, none of the per-layer ones
    assert f"Train {summary_key('gradient', 'worst_underflow_pct')}: " in console.err + console.out
    assert "fp8_underflow_pct/" not in console.err + console.out

    # resume from the step-8 checkpoint, with one weight broken at batch 10: W&B offline starts
    # a new run file, whose history goes on at the resumed steps; the JSONL sink has them too
    checkpoint = run_folder(tmp_path, "full") / "checkpoints" / f"ep0-ba{RESUME_AT}-rank0.pt"
    with added_to_trainer([_BreakWeight()]):
        run_tiny(tmp_path, tiny_data, _overrides("resumed", load_path=str(checkpoint)),
                 wandb=True).close()
    [resumed] = wandb_history.read_runs(run_folder(tmp_path, "resumed"), wait=120)
    assert resumed.complete
    assert resumed.steps("loss/train/total") == list(range(RESUME_AT, BATCHES))
    assert _logging_steps(resumed) == [8, 10]
    for key in sorted(LAYER_KEYS | SUMMARY_KEYS):
        assert resumed.steps(key) == [8, 10], key
    jsonl = [step for step, m in read_jsonl(run_folder(tmp_path, "resumed") / "metrics.jsonl")
             if LAYER_KEYS <= m.keys()]
    assert jsonl == [8, 10]
    # the same model state at step 8 gives the same statistics in both runs
    resumed_8 = next(r for r in resumed.rows if r["_step"] == 8 and LAYER_KEYS <= r.keys())
    full_8 = next(r for r in run.rows if r["_step"] == 8 and LAYER_KEYS <= r.keys())
    assert {k: resumed_8[k] for k in LAYER_KEYS} == {k: full_8[k] for k in LAYER_KEYS}
    # the broken weight: counted in the summary at step 10, named in the fit-end table with
    # the YAML key that changes it
    at_10 = next(r for r in resumed.rows if r["_step"] == 10 and SUMMARY_KEYS <= r.keys())
    assert at_10[summary_key("weight", "flagged_layers")] == 1
    assert at_10[summary_key("weight", "worst_overflow_pct")] > 50
    assert resumed.media("table-file") == {TABLE_NAME: [8, 12]}
    columns, rows = resumed.table(TABLE_NAME, 12)
    flags = {(r[1], r[2]): r[-1] for r in rows}
    assert {r[columns.index("step")] for r in rows} == {10}  # the fit-end table at W&B step 12
    assert "algorithms.te_swap.fp8_recipe.scaling: current" in flags[(BROKEN, "weight")], flags


KINDS = ("hyperparameters", "images", "metrics", "table")


class RefusesFP8(LoggerDestination):
    """A logger destination that raises at what foundry_fp8 sends it of `kinds` (as W&B does
    when its service is gone), to be placed before the `jsonl` logger and W&B. It takes
    Composer's own series: Composer calls its destinations unguarded, so a loss it refused
    would end any run, ours or not."""

    def __init__(self, kinds: Sequence[str] = KINDS):
        self.kinds = set(kinds)

    def _refuse(self, kind: str, keys: Iterable[str] = ("fp8",)) -> None:
        if kind in self.kinds and any(key.startswith("fp8") for key in keys):
            raise RuntimeError("refused")

    def log_metrics(self, metrics, step=None) -> None:
        self._refuse("metrics", metrics)

    def log_hyperparameters(self, hyperparameters) -> None:
        self._refuse("hyperparameters", hyperparameters)

    def log_images(self, *args, **kwargs) -> None:
        self._refuse("images")

    def log_table(self, *args, **kwargs) -> None:
        self._refuse("table")


FAULTY = "blocks.1.attn.out_proj"


@pytest.mark.slow
def test_a_failing_logger_before_jsonl_and_wandb_takes_nothing_from_them(tmp_path, tiny_data,
                                                                        capfd):
    """fp8_stats' series, images, table and summary, fp8_guard's series and records, te_swap's
    and fp8_lint's hyperparameters all reach the `jsonl` logger and W&B after it; the guard
    still moves the faulty layer to high precision; one warning per kind names the logger."""
    overrides = _overrides("refused")
    overrides["callbacks"]["fp8_guard"] = {"consecutive": 2}
    with added_to_trainer([InjectOutlier(FAULTY, start=4)], [RefusesFP8()]):
        trainer = run_tiny(tmp_path, tiny_data, overrides, wandb=True)
    guard = next(c for c in trainer.state.callbacks if isinstance(c, FP8Guard))
    trainer.close()
    assert not guard.disabled and list(guard.core.fallbacks) == [FAULTY]
    steps = [0, 2, 4, 6, 8, 10]
    series = LAYER_KEYS | SUMMARY_KEYS | {FALLBACK_LAYERS, FP8_FLOPS_SHARE}
    folder = run_folder(tmp_path, "refused")
    jsonl: dict[int, dict] = {}
    for step, metrics in read_jsonl(folder / "metrics.jsonl"):
        jsonl.setdefault(step, {}).update(metrics)
    for key in sorted(series):
        assert [s for s in sorted(jsonl) if key in jsonl[s]] == _steps_of(key, steps), key
    assert jsonl[10][FALLBACK_LAYERS] == 1
    [run] = wandb_history.read_runs(folder, wait=120)
    assert run.complete
    for key in sorted(series):
        assert run.steps(key) == _steps_of(key, steps), key
    assert any(r.get(FALLBACK_LAYERS) == 1 for r in run.rows)
    assert all(at == [4, 8, 12] for at in run.media("images/separated").values())
    assert run.media("table-file") == {TABLE_NAME: [4, 8, 12]}
    hyperparameters = {"fp8/stats_summary", f"fp8/guard/fallback/{FAULTY}", "fp8/guard/fallbacks",
                       "fp8/backend", "fp8/coverage", "fp8_lint/findings"}
    assert hyperparameters <= json.loads((folder / "hparams.json").read_text()).keys()
    assert hyperparameters <= run.config.keys()
    warned = re.findall(r"WARNING: .*the logger RefusesFP8 failed to log (\w+) \(RuntimeError: "
                        r"refused\)", capfd.readouterr().err)
    assert sorted(warned) == list(KINDS)


KILLED_AT = 11  # the batch the first attempt is killed at: after its checkpoint at RESUME_AT
RUN_ID = "fp8-killed-and-resumed"

#: The first attempt, in its own process (SIGKILL ends it as a crash would, W&B's and MLflow's
#: queues included): argv is tmp_path, the tiny data's root, vocab size and samples.
_KILLED_ATTEMPT = f"""
import os, signal, sys
from pathlib import Path
from composer.core import Callback
from foundry_fp8.tools.tiny_data import TinyData
from tests.test_wandb_sink import _resumed_overrides, added_to_trainer
from tests.tiny_run import run_tiny

class Kill(Callback):
    def batch_start(self, state, logger):
        if int(state.timestamp.batch) == {KILLED_AT}:
            os.kill(os.getpid(), signal.SIGKILL)

tmp, root, vocab, samples = sys.argv[1:]
with added_to_trainer([Kill()]):
    run_tiny(Path(tmp), TinyData(Path(root), int(vocab), int(samples)),
             _resumed_overrides(Path(tmp)), wandb=True)
"""


def _resumed_overrides(tmp_path, **extra) -> dict:
    """Both attempts: one W&B run id (`resume: allow`, offline), one MLflow experiment, and
    Composer's usual callbacks beside ours."""
    overrides = _overrides("killed", **extra)
    overrides["callbacks"].update({
        "speed_monitor": {"window_size": 2}, "lr_monitor": {}, "memory_monitor": {},
        "runtime_estimator": {},
        "optimizer_monitor": {"log_optimizer_metrics": True, "batch_log_interval": 1}})
    overrides["loggers"] = {
        "wandb": {"init_kwargs": {"id": RUN_ID, "resume": "allow"}},
        "mlflow": {"tracking_uri": f"file://{tmp_path}/mlruns", "experiment_name": "killed",
                   "log_duplicated_metric_every_n_steps": 0}}
    return overrides


@pytest.mark.slow
def test_a_run_killed_and_resumed_into_the_same_wandb_and_mlflow_run_keeps_every_fp8_value(
        tmp_path, tiny_data, monkeypatch):
    """W&B offline ignores `resume` and writes each attempt to its own file under the one id:
    the killed attempt's holds every FP8 key at each of its logging steps up to the last row
    written before the kill, the resumed one's from the checkpoint on; the steps both hold
    have the same values in both, so whichever copy W&B keeps (online, it drops the resumed
    run's steps below those it holds: wandb/sdk/internal/handler.py, `step < self._step`) the
    user sees the uninterrupted run's numbers, every logging step in one file or the other.
    MLflow resumed into the same run id keeps both copies of those steps, equal."""
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from tests.tiny_run import TINY_YAML, own_wandb_env

    monkeypatch.setenv("MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE", "1")  # its file store's race
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_ATTEMPT, str(tmp_path), str(tiny_data.root),
         str(tiny_data.vocab_size), str(tiny_data.num_samples)],
        cwd=TINY_YAML.parents[1], capture_output=True, text=True, timeout=600,
        env=own_wandb_env())
    assert killed.returncode == -9, killed.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"file://{tmp_path}/mlruns")
    [experiment] = [e for e in client.search_experiments() if e.name == "killed"]
    [first_run] = client.search_runs([experiment.experiment_id])
    monkeypatch.setenv("MLFLOW_RUN_ID", first_run.info.run_id)  # Composer resumes that run
    checkpoint = run_folder(tmp_path, "killed") / "checkpoints" / f"ep0-ba{RESUME_AT}-rank0.pt"
    run_tiny(tmp_path, tiny_data, _resumed_overrides(tmp_path, load_path=str(checkpoint)),
             wandb=True).close()

    killed_file, resumed_file = wandb_history.run_files(run_folder(tmp_path, "killed"))
    first = wandb_history.read_run(killed_file)  # never complete: no waiting for it
    [second] = wandb_history.read_runs(resumed_file.parent, wait=120)
    assert killed_file.name == resumed_file.name == f"run-{RUN_ID}.wandb"
    assert not first.complete and second.complete
    assert "no exit record: the run was killed" in wandb_history.describe([first])
    # the kill loses what W&B had not written yet: the killed attempt's file holds its rows up
    # to some step after the checkpoint (in a run here, 9 of 10: the last logging step's row
    # went with the process), each row whole; the resumed attempt logs them again
    held = first.steps("loss/train/total")
    assert RESUME_AT < len(held) <= KILLED_AT and held == list(range(len(held)))
    assert second.steps("loss/train/total") == list(range(RESUME_AT, BATCHES))
    logging_steps = [0, 2, 4, 6, 8, 10]
    for run, steps in ((first, [s for s in logging_steps if s < len(held)]), (second, [8, 10])):
        for key in sorted(LAYER_KEYS | SUMMARY_KEYS):
            assert run.steps(key) == _steps_of(key, steps), (run.path, key)

    def values(run: wandb_history.WandbRun) -> dict[tuple[str, int], float]:
        return {(key, row["_step"]): value for row in run.rows for key, value in row.items()
                if key in LAYER_KEYS | SUMMARY_KEYS}

    before, after = values(first), values(second)
    repeated = after.keys() & before.keys()
    assert {step for _, step in repeated} == {s for s in (8, 10) if s < len(held)}
    assert {key: before[key] for key in repeated} == {key: after[key] for key in repeated}

    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == first_run.info.run_id
    for key in sorted(LAYER_KEYS | SUMMARY_KEYS):
        held: dict[int, list[float]] = {}
        for metric in client.get_metric_history(run.info.run_id, key):
            held.setdefault(metric.step, []).append(metric.value)
        # the resumed attempt's steps are all there; the killed one's queue may have lost its
        # last steps (MLflow logs asynchronously), but every value held is the run's own
        assert {8, 10} <= held.keys(), key
        for step, copies in held.items():
            assert copies == [{**before, **after}[key, step]] * len(copies), (key, step)


#: One attempt of a W&B offline run in its own process, W&B's own writer: argv is the folder and
#: `kill` (SIGKILL once the file holds 10 rows, as a crash would) or `finish` (a resume that
#: ends well). Row `s` holds `x<k>` = s * k; the killed attempt logs steps 0..39, the resumed one
#: 3..42.
_ATTEMPT = """
import os, signal, sys, time
from pathlib import Path
import wandb
from foundry_fp8 import wandb_history

folder, kill = Path(sys.argv[1]), sys.argv[2] == "kill"
run = wandb.init(mode="offline", id="fp8-attempts", resume="allow", dir=str(folder), project="p")
for step in range(0 if kill else 3, 40 if kill else 43):
    run.log({f"x{k}": float(step * k) for k in range(100)}, step=step)
deadline = time.monotonic() + 60
while kill and time.monotonic() < deadline:
    files = wandb_history.run_files(folder)
    if files and len(wandb_history.read_run(files[-1]).rows) >= 10:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
run.finish()
"""


def _attempt(folder, how: str):
    import subprocess
    import sys

    from tests.tiny_run import TINY_YAML, own_wandb_env

    folder.mkdir(exist_ok=True)  # W&B writes elsewhere when `dir` does not exist
    return subprocess.run([sys.executable, "-c", _ATTEMPT, str(folder), how],
                          cwd=TINY_YAML.parents[1], capture_output=True, text=True, timeout=300,
                          env=own_wandb_env())


def test_read_runs_reads_a_killed_attempt_without_waiting_for_it(tmp_path, monkeypatch):
    """A killed attempt's file never gets its exit record: `read_runs(wait=...)` waited its whole
    timeout for it (120 s in the tests, 60 s in `make run`'s demo and the resumed-report test).
    Dead (a later attempt of the run id), it is read as it stands, marked killed; a lone file
    without its exit record is waited for, and not past `wait`."""
    import shutil
    import signal

    killed = _attempt(tmp_path / "run", "kill")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = _attempt(tmp_path / "run", "finish")
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    def no_sleep(seconds: float) -> None:
        raise AssertionError(f"read_runs waited ({seconds} s) for a run that will not finish")

    # the finished attempt's exit record: W&B's service may write it after its process ended
    finished = wandb_history.run_files(tmp_path / "run")[-1]
    for _ in range(240):
        if wandb_history.read_run(finished).complete:
            break
        time.sleep(0.5)

    with monkeypatch.context() as m:
        m.setattr(wandb_history.time, "sleep", no_sleep)
        first, second = wandb_history.read_runs(tmp_path / "run", wait=120)
    assert first.path.name == second.path.name == "run-fp8-attempts.wandb"
    assert (first.complete, first.killed, second.complete, second.killed) == (
        False, True, True, False)
    held = first.steps("x5")
    assert 10 <= len(held) < 40 and held == list(range(len(held)))
    assert second.steps("x5") == list(range(3, 43))
    assert all(row["x5"] == 5.0 * row["_step"] for run in (first, second) for row in run.rows)
    assert f"{first.path}: {len(held)} history rows (no exit record: the run was killed)\n" in (
        wandb_history.describe([first, second]))

    # the killed attempt alone: it may be a run still writing; waited for up to `wait`, then
    # read with one warning
    alone = tmp_path / "alone" / first.path.parent.name
    shutil.copytree(first.path.parent, alone)
    copy = alone / first.path.name
    [run] = wandb_history.read_runs(tmp_path / "alone")  # no wait asked: none, no warning
    assert not run.complete and not run.killed and run.steps("x5") == held
    with pytest.warns(UserWarning, match=rf"^{re.escape(str(copy))}: no exit record after "
                                         r"waiting 0\.1 s: read as it stands"):
        [run] = wandb_history.read_runs(tmp_path / "alone", wait=0.1)
    assert not run.killed and run.steps("x5") == held
