"""`foundry-fp8 report RUN --baseline BASE`: where an FP8 run's training loss departs from its
baseline's, and what was flagged up to then. Both runs are real Composer Trainers on one seed
and data (the FP8 one with te_swap's emulated FP8 and fp8_stats, a weight multiplied by 1e4 as
batch SPIKE starts); the baseline logs with the `jsonl` logger, W&B offline and MLflow at once,
and is read back through each. The expected numbers come from the raw logged losses (the
baseline's as Composer handed them to a logger, the FP8 run's parsed from its file with `json`).
Run as `python -m tests.test_report_baseline FOLDER OPTIONS_JSON` for one training process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry_fp8.cli import main
from foundry_fp8.health.keys import LOSS
from foundry_fp8.health.thresholds import LOSS_GAP_STEPS, MAX_LOSS_GAP
from foundry_fp8.jsonl import JsonlSink

ROOT = Path(__file__).resolve().parents[1]
BATCHES, SPIKE = 16, 8
WANDB_ID = "bf16-baseline"


def _train(folder: Path, options: dict[str, Any]) -> None:
    """One run into `folder`: `fp8` (te_swap emulated, fp8_stats every batch, the SPIKE),
    `wandb` and `mlflow` (those loggers too). `losses.json`: each loss as Composer logged it."""
    from composer import Callback, Trainer
    from composer.loggers import LoggerDestination
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.jsonl_logger import JSONLLogger
    from foundry_fp8.composer.state import FP8State
    from foundry_fp8.composer.stats import FP8Stats
    from foundry_fp8.composer.te_swap import TESwap
    from tests.test_state_restore import TwoBlocks

    class Spike(Callback):
        def batch_start(self, state, logger):
            if int(state.timestamp.batch) == SPIKE:
                with torch.no_grad():
                    state.model.module.blocks[1].weight.mul_(1e4)

    class Losses(LoggerDestination):
        def __init__(self):
            self.logged: dict[int, float] = {}

        def log_metrics(self, metrics, step=None):
            if LOSS in metrics:
                self.logged[int(step)] = float(metrics[LOSS])

    losses = Losses()
    loggers: list[LoggerDestination] = [JSONLLogger(path=str(folder / "metrics.jsonl")), losses]
    folder.mkdir(parents=True, exist_ok=True)
    if options.get("wandb"):
        from composer.loggers import WandBLogger

        loggers.append(WandBLogger(project="fp8-baseline", init_kwargs={
            "mode": "offline", "dir": str(folder), "id": WANDB_ID,
            "settings": {"allow_offline_artifacts": False}}))
    if options.get("mlflow"):
        from composer.loggers import MLFlowLogger

        loggers.append(MLFlowLogger(tracking_uri=f"file://{folder}/mlruns", experiment_name="b",
                                    log_duplicated_metric_every_n_steps=0))
    fp8 = options.get("fp8", False)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16 * BATCHES, 16) * 3, torch.randint(0, 16, (16 * BATCHES,)))
    trainer = Trainer(
        model=ComposerClassifier(TwoBlocks(), num_classes=16), seed=17,
        train_dataloader=DataLoader(data, batch_size=16), max_duration=f"{BATCHES}ba",
        algorithms=[TESwap(backend="emulate")] if fp8 else [],
        callbacks=[FP8State(), FP8Stats(interval=1), Spike()] if fp8 else [],
        loggers=loggers, device="cpu", progress_bar=False, log_to_console=False)
    trainer.fit()
    trainer.close()
    (folder / "losses.json").write_text(json.dumps(losses.logged))


def _run(folder: Path, **options: Any) -> dict[int, float]:
    from tests.tiny_run import own_wandb_env

    done = subprocess.run([sys.executable, "-m", "tests.test_report_baseline", str(folder),
                           json.dumps(options)], cwd=ROOT, env=own_wandb_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {int(s): v for s, v in json.loads((folder / "losses.json").read_text()).items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[int, float], Path, dict[int, float]]:
    """(FP8 run folder, its losses parsed from its metrics.jsonl, baseline folder, the
    baseline's losses as Composer logged them)."""
    root = tmp_path_factory.mktemp("runs")
    fp8, base = root / "fp8", root / "bf16"
    _run(fp8, fp8=True, mlflow=True)
    logged = _run(base, wandb=True, mlflow=True)
    raw = {}
    for line in (fp8 / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if LOSS in record["metrics"]:
            raw[record["step"]] = float(record["metrics"][LOSS])
    return fp8, raw, base, logged


def expected(run: dict[int, float], base: dict[int, float]) -> int | None:
    """The departure, worked out here from the rule's words: at the steps both logged with a
    finite baseline, the first of LOSS_GAP_STEPS in a row where the run's loss is more than
    MAX_LOSS_GAP of the baseline's above it, or the first NaN/Inf of the run's (its streak's
    first step)."""
    steps = [s for s in sorted(run) if s in base and math.isfinite(base[s])]
    for i, s in enumerate(steps):
        for j, t in enumerate(steps[i:i + LOSS_GAP_STEPS]):
            if math.isfinite(run[t]) and run[t] <= base[t] * (1 + MAX_LOSS_GAP):
                break
            if not math.isfinite(run[t]) or j == LOSS_GAP_STEPS - 1:
                return s
    return None


def headline(out: str) -> str:
    return next(line.strip() for line in out.splitlines() if "the baseline" in line)


def test_the_spike_that_made_the_loss_depart_is_named_with_the_step(runs, capsys):
    fp8, raw, base, logged = runs
    assert set(raw) == set(logged) == set(range(BATCHES))
    step = expected(raw, logged)
    assert step == SPIKE  # the emulated FP8 tracks the baseline until the weight is spiked
    for given in (base, base / "metrics.jsonl", base / "wandb", base / "mlruns"):
        assert main(["report", str(fp8), "--baseline", str(given), "--out",
                     str(fp8 / "out")]) == 0
        line = headline(capsys.readouterr().out)
        assert line.startswith(
            f"Loss departs from the baseline {given} at step {SPIKE}: {raw[SPIKE]:.4g} vs "
            f"{logged[SPIKE]:.4g} ({100 * (raw[SPIKE] / logged[SPIKE] - 1):+.3g} %; "), line
        assert f"; {BATCHES} steps compared). Flagged up to step {SPIKE}: " in line, line
        # nothing flagged before the spike; the spiked weight and the gradient it sent back
        assert line.endswith(f"Flagged up to step {SPIKE}: 'module.blocks.0' gradient cos_sim "
                             f"(from step {SPIKE}); 'module.blocks.1' weight overflow_pct (from "
                             f"step {SPIKE})."), line
    markdown = (fp8 / "out" / "fp8_report.md").read_text()
    assert f"Loss departs from the baseline `{base / 'mlruns'}` at step {SPIKE}: " in markdown
    assert markdown.index("Loss departs") < markdown.index("| layer | tensor |")


def test_an_mlflow_run_against_a_jsonl_baseline(runs, tmp_path, capsys):
    """The FP8 run read with MLflow's client (its loss too), the baseline its metrics.jsonl."""
    fp8, raw, base, logged = runs
    assert main(["report", str(fp8 / "mlruns"), "--baseline", str(base), "--out",
                 str(tmp_path)]) == 0
    line = headline(capsys.readouterr().out)
    assert line.startswith(f"Loss departs from the baseline {base} at step {SPIKE}: "
                           f"{raw[SPIKE]:.4g} vs {logged[SPIKE]:.4g} "), line


def _written(folder: Path, losses: dict[int, float]) -> Path:
    sink = JsonlSink(folder / "metrics.jsonl")
    for step, loss in sorted(losses.items()):
        sink.write(step, {LOSS: loss})
    return folder


@pytest.mark.parametrize("case", ["every 3rd", "gaps and NaN", "shorter", "no common step"])
def test_baselines_logged_otherwise_are_compared_at_the_steps_both_logged(runs, tmp_path, capsys,
                                                                          case):
    """A baseline logged every 3rd step, with steps missing and a NaN loss, ending before the
    run, or at no step the run logged: written with the jsonl logger's sink from the real
    baseline's losses."""
    fp8, raw, _, logged = runs
    kept = {"every 3rd": {s: v for s, v in logged.items() if s % 3 == 0},
            "gaps and NaN": {s: (math.nan if s == SPIKE + 1 else v) for s, v in logged.items()
                             if s not in (SPIKE + 2, 3)},
            "shorter": {s: v for s, v in logged.items() if s <= SPIKE + 1},
            "no common step": {s + BATCHES: v for s, v in logged.items()}}[case]
    base = _written(tmp_path / "base", kept)
    assert main(["report", str(fp8), "--baseline", str(base), "--out", str(tmp_path)]) == 0
    line = headline(capsys.readouterr().out)
    step = expected(raw, kept)
    compared = [s for s in sorted(raw) if s in kept and math.isfinite(kept[s])]
    if step is not None:
        assert line.startswith(f"Loss departs from the baseline {base} at step {step}: "
                               f"{raw[step]:.4g} vs {kept[step]:.4g} "), line
        assert f"; {len(compared)} steps compared)" in line, line
    elif compared:
        assert line.startswith(f"Loss within the baseline {base} at all {len(compared)} compared "
                               f"steps ({compared[0]} to {compared[-1]}; "), line
        assert line.endswith(f"; the baseline's loss ends at step {max(kept)}, this run's at "
                             f"{max(raw)}: the steps after are not compared."), line
    else:
        assert line.startswith(f"Loss vs the baseline {base}: no step where both logged"), line
    assert {"every 3rd": SPIKE + 1, "gaps and NaN": SPIKE, "shorter": None,
            "no common step": None}[case] == step


def test_a_nan_loss_departs_at_once(runs, tmp_path, capsys):
    """The run's loss NaN from step 5 (as the jsonl logger writes it, "nan"): departed there,
    with no LOSS_GAP_STEPS to wait, before anything was flagged."""
    fp8, raw, base, logged = runs
    run = tmp_path / "run"
    run.mkdir()
    lines = []
    for line in (fp8 / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["step"] >= 5 and LOSS in record["metrics"]:
            record["metrics"][LOSS] = "nan"
        lines.append(json.dumps(record))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["report", str(run), "--baseline", str(base / "wandb")]) == 0
    line = headline(capsys.readouterr().out)
    assert line.startswith(f"Loss departs from the baseline {base / 'wandb'} at step 5: nan vs "
                           f"{logged[5]:.4g} (NaN/Inf; "), line
    assert line.endswith(f"No layer flagged up to step 5 (the first at step {SPIKE})."), line


@pytest.mark.parametrize("setup, message", [
    (lambda p: (p / "notes.txt").write_text("not a run\n") and p / "notes.txt",
     "notes.txt: no metrics record; 1 line does not decode as JSON"),
    (lambda p: p, "metrics.jsonl: not found"),
    (lambda p: p / "missing", "missing: not found"),
    (lambda p: _written(p, {0: math.nan, 1: math.inf}), "NaN/Inf at each of its 2 logged steps"),
])
def test_a_baseline_that_is_not_a_run_is_one_line_and_exit_2(runs, tmp_path, capsys, setup,
                                                              message):
    fp8 = runs[0]
    given = setup(tmp_path)
    assert main(["report", str(fp8), "--baseline", str(given), "--out", str(tmp_path / "o")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: --baseline "), \
        captured.err
    assert message in captured.err, captured.err
    assert not (tmp_path / "o").exists()


def test_a_baseline_with_fp8_statistics_but_no_loss_says_so(runs, tmp_path, capsys):
    fp8 = runs[0]
    run = tmp_path / "stats_only"
    run.mkdir()
    kept = [json.dumps({**r, "metrics": {k: v for k, v in r["metrics"].items() if k != LOSS}})
            for r in map(json.loads, (fp8 / "metrics.jsonl").read_text().splitlines())]
    (run / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    assert main(["report", str(fp8), "--baseline", str(run)]) == 2
    assert capsys.readouterr().err == (f"error: --baseline {run}: no `{LOSS}` logged (the "
                                       "training loss Composer logs at every batch), nothing to "
                                       "compare\n")


if __name__ == "__main__":
    _train(Path(sys.argv[1]), json.loads(sys.argv[2]))
