"""A post-mortem of a run that diverged: a real Composer run (te_swap's emulated FP8, fp8_stats,
the `jsonl` logger and W&B offline) in which one element of one layer's weight grows 1e6-fold
as batch BREAK starts, so that weight's amax jumps past its scale and the rest of it underflows
from then on, and the loss spikes. `foundry-fp8 report` is run on it as a user would, from
another folder, on the JSONL and on the W&B file. The run writes into the relative run folder
`div` (`save_folder: div/checkpoints`) with `dump_folder: div/dumps`, which repeats that one-part
run folder: the run takes it as div/dumps (`paths.repeated_run_folder`), and the report must
link the dump there. The report's loss line names the loss spike and its distance from the
first FP8 flag; the same run without the break (`healthy`) has none. Its time-series figure keeps
few ticks on its log axes spanning many decades. Run as `python -m tests.test_report_divergence
PROJECT [healthy]` for the run."""

from __future__ import annotations

import io
import itertools
import json
import math
import statistics
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest
import torch

from foundry_fp8.cli import main
from foundry_fp8.health.keys import LOSS
from foundry_fp8.health.thresholds import (
    LOSS_SPIKE_JUMP,
    LOSS_SPIKE_MIN,
    LOSS_SPIKE_RATIO,
    LOSS_SPIKE_STEPS,
    LOSS_SPIKE_WINDOW,
)

ROOT = Path(__file__).resolve().parents[1]
BATCHES, BREAK, BROKEN, INTERVAL = 40, 16, 2, 2
LAYER = f"module.blocks.{BROKEN}"
STATS = {"interval": INTERVAL, "dump_steps": [BREAK], "dump_folder": "div/dumps"}


def _train(project: Path, broken: bool = True) -> None:
    """The run, started in `project`, writing into `project`/div; without the break where not
    `broken`."""
    from composer import Callback, Trainer
    from composer.loggers import WandBLogger
    from composer.models import ComposerClassifier
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.jsonl_logger import JSONLLogger
    from foundry_fp8.composer.state import FP8State
    from foundry_fp8.composer.stats import FP8Stats
    from foundry_fp8.composer.te_swap import TESwap

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])

        def forward(self, x):
            for block in self.blocks[:-1]:
                x = torch.relu(block(x))
            return self.blocks[-1](x)

    class Break(Callback):
        """One element of the BROKEN layer's weight x1e6 as batch BREAK starts; and the run's
        config logged as LLM-Foundry logs its YAML (what the report reads fp8_stats' options
        from)."""

        def fit_start(self, state, logger):
            logger.log_hyperparameters({"run_name": "div", "save_folder": "div/checkpoints",
                                        "callbacks": {"fp8_stats": STATS}})

        def batch_start(self, state, logger):
            if broken and int(state.timestamp.batch) == BREAK:
                with torch.no_grad():
                    state.model.module.blocks[BROKEN].weight[0, 0] *= 1e6

    (project / "div").mkdir(parents=True)  # W&B writes into `dir` only if it exists
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8 * BATCHES, 32), torch.randint(0, 32, (8 * BATCHES,)))
    Trainer(model=ComposerClassifier(Net(), num_classes=32), seed=1, run_name="div",
            train_dataloader=DataLoader(data, batch_size=8), max_duration=f"{BATCHES}ba",
            algorithms=[TESwap(backend="emulate")],
            callbacks=[FP8State(), FP8Stats(**STATS), Break()],
            loggers=[JSONLLogger(), WandBLogger(project="div", init_kwargs={
                "mode": "offline", "dir": "div", "settings": {"allow_offline_artifacts": False}})],
            device="cpu", progress_bar=False, log_to_console=False,
            save_folder="div/checkpoints", save_interval=f"{BATCHES}ba").fit()


def _trained(tmp_path_factory, *how: str) -> Path:
    """The finished run's folder (its JSONL, W&B folder and dumps)."""
    from tests.tiny_run import own_wandb_env

    project = tmp_path_factory.mktemp("project")
    done = subprocess.run([sys.executable, "-m", "tests.test_report_divergence", str(project),
                           *how], cwd=project, env=own_wandb_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return project / "div"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return _trained(tmp_path_factory)


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    return _trained(tmp_path_factory, "healthy")


def _first_flagged(capsys, argument: str) -> str:
    capsys.readouterr()
    assert main(["report", argument, "--out", str(Path(argument).parent / "out")]) == 0
    return next(line.strip() for line in capsys.readouterr().out.splitlines()
                if line.strip().startswith("First flagged"))


def _raw(run: Path) -> dict[int, dict[str, float]]:
    """step -> metrics of the run's metrics.jsonl, parsed with plain `json`."""
    steps: dict[int, dict[str, float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], {}).update(record["metrics"])
    return steps


def test_the_run_is_healthy_until_the_break_and_its_weight_spikes_there(run):
    """The premise, from the raw file: nothing flagged before BREAK; there the broken weight's
    amax is 1e5 times what it was, and the loss spikes within the next logging steps."""
    raw = _raw(run)
    assert all(m["fp8/flagged_layers"] == 0 for s, m in raw.items()
               if s < BREAK and "fp8/flagged_layers" in m)
    before, at = (raw[s][f"fp8_amax/weight/{LAYER}"] for s in (BREAK - INTERVAL, BREAK))
    assert at > 1e5 * before
    losses = {s: m["loss/train/total"] for s, m in raw.items() if "loss/train/total" in m}
    assert max(v for s, v in losses.items() if s > BREAK) > 100 * max(
        v for s, v in losses.items() if s < BREAK)


@pytest.mark.parametrize("source", ["jsonl", "wandb"])
def test_the_report_names_the_broken_weight_at_the_break_and_links_its_dump(
        run, tmp_path, monkeypatch, capsys, source):
    """From another folder, with the run folder's absolute path: the first flag is the broken
    layer's weight at BREAK, and its dump is the one fp8_stats wrote at div/dumps. Before, the
    report looked for `div/dumps` inside the run folder written absolute (div/div/dumps, as a
    run folder written with more parts would have put it) and named no dump."""
    monkeypatch.chdir(tmp_path)
    dump = run / "dumps" / f"step{BREAK:07d}-rank0.safetensors"
    assert dump.is_file()
    argument = run if source == "jsonl" else run / "wandb" / "latest-run"
    line = _first_flagged(capsys, str(argument))
    assert line.startswith(f"First flagged at step {BREAK}: '{LAYER}' weight "), line
    assert line.endswith(f"fp8_stats' dump of '{LAYER}' weight there: {dump}."), line


def _reference_spikes(losses: dict[int, float]) -> list[tuple[int, int | None]]:
    """The loss spikes, (first step, step back within the ratio), read off the losses of a run
    that logs every step: from a step whose loss is NaN/Inf or more than LOSS_SPIKE_JUMP times
    the median (`statistics.median`) of up to LOSS_SPIKE_WINDOW finite losses outside spikes
    logged before it (LOSS_SPIKE_MIN at least), or more than LOSS_SPIKE_RATIO times it at
    LOSS_SPIKE_STEPS steps in a row, to the next finite loss within the ratio."""
    before: deque[float] = deque(maxlen=LOSS_SPIKE_WINDOW)
    steps, found, i = sorted(losses), [], 0
    while i < len(steps):
        loss = losses[steps[i]]
        median = statistics.median(before) if len(before) >= LOSS_SPIKE_MIN else None
        ahead = [losses[s] for s in steps[i:i + LOSS_SPIKE_STEPS]]
        if not math.isfinite(loss) or median is not None and (
                loss > LOSS_SPIKE_JUMP * median or len(ahead) == LOSS_SPIKE_STEPS and all(
                    not math.isfinite(v) or v > LOSS_SPIKE_RATIO * median for v in ahead)):
            limit = math.inf if median is None else LOSS_SPIKE_RATIO * median
            back = next((j for j in range(i + 1, len(steps))
                         if math.isfinite(losses[steps[j]]) and losses[steps[j]] <= limit), None)
            found.append((steps[i], None if back is None else steps[back]))
            if back is None:
                break
            i = back
        before.append(losses[steps[i]])
        i += 1
    return found


def _loss_lines(capsys, argument: Path, out: Path) -> tuple[str, str]:
    """The report's loss line on the terminal and in fp8_report.md."""
    capsys.readouterr()
    assert main(["report", str(argument), "--out", str(out)]) == 0
    said = [line.strip() for line in capsys.readouterr().out.splitlines()
            if line.strip().startswith("Loss")]
    written = [line for line in (out / "fp8_report.md").read_text().splitlines()
               if line.startswith("Loss")]
    assert len(said) == len(written) == 1, (said, written)
    return said[0], written[0]


@pytest.mark.parametrize("source", ["jsonl", "wandb"])
def test_the_loss_line_names_the_spike_and_how_far_after_the_first_flag(run, tmp_path, capsys,
                                                                         source):
    """D2-21: without --baseline the report never said the loss had spiked, what a post-mortem
    looks for first. The run's loss jumps 1600x at step 18 and is back the next, then jumps
    again (`_reference_spikes`, from the raw file; each a jump: none lasts LOSS_SPIKE_STEPS
    steps): the line names the first at or after the first FP8 flag (the broken weight at
    BREAK), how many steps after it, where the loss came back, and the later spikes."""
    losses = {s: m[LOSS] for s, m in _raw(run).items() if LOSS in m}
    spikes = _reference_spikes(losses)
    assert len(spikes) >= 2 and all(back is not None for _, back in spikes)  # it came back
    (spiked, back), later = spikes[0], spikes[1:]
    assert BREAK <= spiked <= BREAK + 4  # nothing before the break
    argument = run if source == "jsonl" else run / "wandb" / "latest-run"
    terminal, markdown = _loss_lines(capsys, argument, tmp_path / "out")
    assert terminal == markdown
    assert terminal.startswith(f"Loss spikes at step {spiked}: {losses[spiked]:.4g}, "), terminal
    named = ", ".join(f"{s} (back at {b})" for s, b in later[:3]) + (
        f" and {len(later) - 3} more" if len(later) > 3 else "")
    assert terminal.endswith(
        f", {spiked - BREAK} steps after the first FP8 flag (step {BREAK}). Back within the ratio"
        f" at step {back}. {len(later)} spike{'s' if len(later) > 1 else ''} after it, "
        f"recovered: at step{'s' if len(later) > 1 else ''} {named}."), terminal


def test_the_same_run_without_the_break_has_no_loss_spike(healthy, tmp_path, capsys):
    """The run without the break: a noisy loss (it rises at some steps) that never spikes by the
    rule; the report says so over its logged steps, and flags nothing."""
    losses = {s: m[LOSS] for s, m in _raw(healthy).items() if LOSS in m}
    steps = sorted(losses)
    assert sum(losses[b] > losses[a] for a, b in itertools.pairwise(steps)) >= len(steps) // 4
    assert _reference_spikes(losses) == []
    terminal, markdown = _loss_lines(capsys, healthy, tmp_path / "out")
    assert terminal == markdown
    assert terminal.startswith(f"Loss: no spike at the logged steps {steps[0]} to {steps[-1]} ("
                               ), terminal


def test_the_time_series_keeps_no_minor_ticks_on_axes_of_many_decades(run):
    """D2-21: the diverged run's amax and scale panels span 5 to 8 decades; their minor ticks
    (840 y ticks in all, each laid out twice by the constrained layout) were half the report's
    time. Beyond MINOR_TICK_DECADES an axis keeps its labelled decades only."""
    from foundry_fp8.health.plots import MINOR_TICK_DECADES, choose_layers, draw_series
    from foundry_fp8.report.cli import load

    metrics = load(run).run
    figure = draw_series(metrics, choose_layers(metrics))
    figure.savefig(io.BytesIO(), format="png")  # drawn: the ticks the layout placed
    wide = [ax for ax in figure.axes if ax.get_yscale() == "log"
            and ax.get_ylim()[1] > 10 ** MINOR_TICK_DECADES * ax.get_ylim()[0]]
    assert len(wide) >= len(figure.axes) // 2  # the premise: a diverged run's range
    assert all(len(ax.yaxis.get_minorticklocs()) == 0 for ax in wide)
    assert sum(len(ax.yaxis.get_ticklocs()) + len(ax.yaxis.get_minorticklocs())
               for ax in figure.axes) <= 12 * len(figure.axes)


def test_a_sweep_names_the_run_whose_loss_spiked(run, healthy, capsys):
    """Several runs reported at once end in one line each: the spike is in the broken run's."""
    losses = {s: m[LOSS] for s, m in _raw(run).items() if LOSS in m}
    capsys.readouterr()
    assert main(["report", str(run), str(healthy)]) == 0
    last = capsys.readouterr().out.splitlines()[-2:]
    assert last[0].startswith(f"  {run}: ") and last[0].endswith(
        f" flagged, loss spikes at step {_reference_spikes(losses)[0][0]}"), last
    assert last[1] == f"  {healthy}: 0 flagged", last


if __name__ == "__main__":
    _train(Path(sys.argv[1]), broken=sys.argv[2:] != ["healthy"])
