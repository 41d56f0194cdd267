"""A post-mortem of a run that diverged: a real Composer run (te_swap's emulated FP8, fp8_stats,
the `jsonl` logger and W&B offline) in which one element of one layer's weight grows 1e6-fold
as batch BREAK starts, so that weight's amax jumps past its scale and the rest of it underflows
from then on, and the loss spikes. `foundry-fp8 report` is run on it as a user would, from
another folder, on the JSONL and on the W&B file. The run writes into the relative run folder
`div` (`save_folder: div/checkpoints`) with `dump_folder: div/dumps`, which repeats that one-part
run folder: the run takes it as div/dumps (`paths.repeated_run_folder`), and the report must
link the dump there. Run as `python -m tests.test_report_divergence PROJECT` for the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foundry_fp8.cli import main

ROOT = Path(__file__).resolve().parents[1]
BATCHES, BREAK, BROKEN, INTERVAL = 40, 16, 2, 2
LAYER = f"module.blocks.{BROKEN}"
STATS = {"interval": INTERVAL, "dump_steps": [BREAK], "dump_folder": "div/dumps"}


def _train(project: Path) -> None:
    """The run, started in `project`, writing into `project`/div."""
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
            if int(state.timestamp.batch) == BREAK:
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


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The finished run's folder (its JSONL, W&B folder and dumps)."""
    from tests.tiny_run import own_wandb_env

    project = tmp_path_factory.mktemp("project")
    done = subprocess.run([sys.executable, "-m", "tests.test_report_divergence", str(project)],
                          cwd=project, env=own_wandb_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return project / "div"


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


if __name__ == "__main__":
    _train(Path(sys.argv[1]))
