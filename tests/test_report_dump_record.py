"""`foundry-fp8 report` finds fp8_stats' dumps of a plain Composer run (no LLM-Foundry config,
so no `callbacks.fp8_stats.dump_folder` among its hyperparameters) from the folder the run
recorded, `fp8/dump_folder`, in whichever sink it reads: the jsonl logger's hparams.json, the
W&B run's config, the MLflow run's params. The report of each looked only in the default
`fp8_dumps` and linked no dump. Real runs (te_swap's emulated FP8) in a child process, as a user
starts them (W&B's `dir` the run folder, as the project's YAMLs set it; MLflow's file store in
the working directory), one weight broken at the dump step so that step is the first flagged.
A resumed attempt with another dump folder: the report finds each attempt's dump where its
sink kept the attempt's record. Run as `python -m tests.test_report_dump_record PROJECT
DUMP_FOLDER ATTEMPT` for an attempt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from foundry_fp8.cli import main
from tests.test_stats_dump_record import NAME, ROOT
from tests.tiny_run import own_wandb_env
from tests.two_linears import TwoLinears

mlflow = pytest.importorskip("mlflow")

BROKEN, DUMPED, LATER = "module.blocks.0", 2, 6  # broken at the first attempt's dump step
BATCHES = 4  # per attempt; the second resumes from the first's last checkpoint
WANDB_ID = "dumprec1"


def _train(project: Path, dump_folder: str, attempt: int) -> None:
    """An attempt, started in `project`: its run folder runs/plain holds metrics.jsonl, its
    checkpoints and W&B's `wandb/`; MLflow's store is project/mlruns. Attempt 1 resumes attempt
    0 from its checkpoint into the same W&B and MLflow runs, dumping at LATER into `dump_folder`."""
    import torch
    from composer import Callback, Trainer
    from composer.loggers import MLFlowLogger, WandBLogger
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.jsonl_logger import JSONLLogger
    from foundry_fp8.composer.state import FP8State
    from foundry_fp8.composer.stats import FP8Stats
    from foundry_fp8.composer.te_swap import TESwap

    class Break(Callback):
        """The weight x1e4 at the start of batch DUMPED: an amax spike its delayed scaling
        meets there, flagged at once (overflow with a scale ratio far above 2)."""

        def batch_start(self, state, logger) -> None:
            if int(state.timestamp.batch) == DUMPED:
                with torch.no_grad():
                    state.model.module.blocks[0].weight.mul_(1e4)

    run = project / "runs" / NAME
    run.mkdir(parents=True, exist_ok=True)  # W&B writes into `dir` only if it exists
    loggers = [JSONLLogger(),
               WandBLogger(project="dumps", init_kwargs={
                   "mode": "offline", "dir": str(run), "id": WANDB_ID, "resume": "allow",
                   "settings": {"allow_offline_artifacts": False}}),
               MLFlowLogger(tracking_uri=(project / "mlruns").as_uri(), experiment_name="dumps",
                            synchronous=True, resume=True)]
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,)))
    Trainer(model=ComposerClassifier(TwoLinears(), num_classes=4), run_name=NAME,
            train_dataloader=DataLoader(data, batch_size=8),
            max_duration=f"{BATCHES * (attempt + 1)}ba", save_folder="runs/{run_name}/checkpoints",
            save_interval=f"{BATCHES}ba", seed=17,  # MLflow refuses a changed rank_zero_seed
            load_path=str(run / "checkpoints" / "latest-rank0.pt") if attempt else None,
            algorithms=[TESwap(backend="emulate")],
            callbacks=[FP8State(), Break(),
                       FP8Stats(interval=2, dump_steps=[[DUMPED, LATER][attempt]],
                                dump_folder=dump_folder)],
            loggers=loggers, device="cpu", progress_bar=False, log_to_console=False).fit()


def _attempt(project: Path, dump_folder: str, attempt: int) -> str:
    """Run an attempt in a child process; its stderr (Composer's and the loggers' warnings)."""
    done = subprocess.run([sys.executable, "-m", "tests.test_report_dump_record", str(project),
                           dump_folder, str(attempt)], cwd=project,
                          env=own_wandb_env(PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _sinks(project: Path) -> dict[str, Path]:
    """What `foundry-fp8 report` is given for each sink of the run."""
    run = project / "runs" / NAME
    [mlrun] = (project / "mlruns").glob("*/*/meta.yaml")
    return {"jsonl": run, "wandb": run / "wandb", "mlflow": mlrun.parent}


def _headline(given: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["report", str(given), "--out", str(out)]) == 0, capsys.readouterr().err
    return next(line for line in capsys.readouterr().out.splitlines()
                if line.strip().startswith("First flagged"))


@pytest.mark.slow
def test_the_report_links_a_plain_runs_dump_from_every_sink(tmp_path, capsys, monkeypatch):
    _attempt(tmp_path, "custom/dumps", 0)
    dump = tmp_path / "runs" / NAME / "custom" / "dumps" / f"step{DUMPED:07d}-rank0.safetensors"
    assert dump.is_file()
    monkeypatch.chdir(tmp_path / "runs")  # the report from elsewhere than the training's folder
    for sink, given in _sinks(tmp_path).items():
        headline = _headline(given, tmp_path / sink, capsys)
        assert headline.startswith(f"  First flagged at step {DUMPED}: '{BROKEN}' weight"), sink
        assert headline.endswith(f" fp8_stats' dump of '{BROKEN}' weight there: {dump}."), (
            sink, headline)
        assert f"`{dump}`" in (tmp_path / sink / "fp8_report.md").read_text(), sink


@pytest.mark.slow
def test_a_resume_with_another_dump_folder(tmp_path):
    """Attempt 1 resumes attempt 0 into the same W&B and MLflow runs and dumps elsewhere (an
    absolute folder). Each attempt's W&B file keeps its own record: both dumps are found. MLflow
    keeps a param's first value and refuses the changed one: attempt 0's dump is found, attempt
    1's only where its folder is the older lookup's. hparams.json is the latest attempt's: its
    record finds attempt 1's dump; attempt 0's (a plain run, no config) is not found."""
    from foundry_fp8.paths import DUMP_FOLDER_KEY
    from foundry_fp8.report.cli import load
    from foundry_fp8.report.read import dump_of, dump_places

    first = tmp_path / "runs" / NAME / "custom" / "dumps" / f"step{DUMPED:07d}-rank0.safetensors"
    second = tmp_path / "later" / f"step{LATER:07d}-rank0.safetensors"
    _attempt(tmp_path, "custom/dumps", 0)
    said = _attempt(tmp_path, str(second.parent), 1)
    assert first.is_file() and second.is_file()
    found = {}
    for sink, given in _sinks(tmp_path).items():
        loaded = load(given)
        places = dump_places(loaded.run_folder or loaded.folder, loaded.hparams, loaded.dumps)
        found[sink] = [dump_of(places, step, BROKEN, "weight") for step in (DUMPED, LATER)]
    assert found == {"jsonl": [None, second], "wandb": [first, second],
                     "mlflow": [first, None]}, said[-3000:]
    assert DUMP_FOLDER_KEY in said  # MLflow refused the changed value (deliver's warning)


def test_records_that_name_no_folder_leave_the_older_lookup(tmp_path):
    """A record a logger turned into another type, empty text or one holding NUL names no
    folder: left out, no traceback, and the older lookup (`fp8_dumps`) still answers; an
    absolute record is looked in as it is, first."""
    import torch
    from safetensors.torch import save_file

    from foundry_fp8.paths import DUMP_FOLDER, DUMP_FOLDER_KEY
    from foundry_fp8.report.read import dump_of, dump_places

    elsewhere, older = tmp_path / "elsewhere", tmp_path / "run" / DUMP_FOLDER
    for folder in (elsewhere, older):
        folder.mkdir(parents=True)
        save_file({f"{BROKEN}/weight": torch.zeros(1)},
                  str(folder / f"step{DUMPED:07d}-rank0.safetensors"))
    for bad in (3, "", "a\x00b", ["custom"]):
        places = dump_places(tmp_path / "run", {DUMP_FOLDER_KEY: bad})
        assert places == [older], bad
        assert dump_of(places, DUMPED, BROKEN, "weight") == (
            older / f"step{DUMPED:07d}-rank0.safetensors")
    places = dump_places(tmp_path / "run", {DUMP_FOLDER_KEY: elsewhere.as_posix()})
    assert places == [elsewhere, older]
    assert dump_of(places, DUMPED, BROKEN, "weight").parent == elsewhere
    assert dump_of(places, DUMPED, "module.blocks.1", "weight") is None


if __name__ == "__main__":
    _train(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
