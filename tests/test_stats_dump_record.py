"""fp8_stats names the folder it writes its dumps into in the run's hyperparameters,
`fp8/dump_folder`, relative to the jsonl logger's folder (absolute where the dumps lie outside
it): a plain Composer run logs no LLM-Foundry config, so the report, which looked for
`callbacks.fp8_stats.dump_folder` there and else in the default `fp8_dumps`, found no dump of a
run with its own `dump_folder`. Read back at every sink the report reads: the jsonl logger's
hparams.json, the `.wandb` file with W&B's own reader and MLflow's params with its client, from
real Composer runs (te_swap's emulated FP8) in a child process, as a user starts them. Run as
`python -m tests.test_stats_dump_record PROJECT DUMP_FOLDER` for the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from foundry_fp8 import wandb_history
from foundry_fp8.paths import DUMP_FOLDER_KEY
from tests.two_linears import TwoLinears

mlflow = pytest.importorskip("mlflow")

ROOT = Path(__file__).resolve().parents[1]
NAME, DUMPED = "plain", 2  # the run's name (its folder runs/plain), its dump step


def _train(project: Path, dump_folder: str, every_sink: bool = True) -> None:
    """The run, started in `project`: its jsonl logger writes runs/plain/metrics.jsonl; W&B
    offline and MLflow too where `every_sink`."""
    import torch
    from composer import Trainer
    from composer.loggers import MLFlowLogger, WandBLogger
    from composer.models import ComposerClassifier
    from torch.utils.data import DataLoader, TensorDataset

    from foundry_fp8.composer.jsonl_logger import JSONLLogger
    from foundry_fp8.composer.state import FP8State
    from foundry_fp8.composer.stats import FP8Stats
    from foundry_fp8.composer.te_swap import TESwap

    loggers = [JSONLLogger()]
    if every_sink:
        (project / "wandb").mkdir()  # W&B writes into `dir` only if it exists
        loggers += [WandBLogger(project="dumps", init_kwargs={
                        "mode": "offline", "dir": str(project / "wandb"),
                        "settings": {"allow_offline_artifacts": False}}),
                    MLFlowLogger(tracking_uri=(project / "mlruns").as_uri(),
                                 experiment_name="dumps", synchronous=True)]
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 16), torch.randint(0, 4, (32,)))
    Trainer(model=ComposerClassifier(TwoLinears(), num_classes=4),
            run_name=NAME, train_dataloader=DataLoader(data, batch_size=8), max_duration="4ba",
            algorithms=[TESwap(backend="emulate")],
            callbacks=[FP8State(), FP8Stats(interval=2, dump_steps=[DUMPED],
                                            dump_folder=dump_folder)],
            loggers=loggers, device="cpu", progress_bar=False, log_to_console=False).fit()


def _recorded(project: Path, recorded: str) -> Path:
    """The record in the jsonl logger's hparams.json, and the dump where the report looks with
    it: the jsonl logger's folder joined with it (an absolute value stays itself)."""
    metrics = project / "runs" / NAME  # the jsonl logger's folder: metrics.jsonl, hparams.json
    hparams = json.loads((metrics / "hparams.json").read_text())
    assert "callbacks" not in hparams  # a plain Composer run: no config to find it in
    assert hparams[DUMP_FOLDER_KEY] == recorded
    dumps = sorted((metrics / recorded).glob(f"step{DUMPED:07d}-rank*.safetensors"))
    assert [p.name for p in dumps] == [f"step{DUMPED:07d}-rank0.safetensors"]
    return metrics


@pytest.mark.slow
def test_the_dump_folder_is_in_every_sinks_hyperparameters(tmp_path):
    from mlflow.tracking import MlflowClient

    from tests.tiny_run import own_wandb_env

    done = subprocess.run([sys.executable, "-m", "tests.test_stats_dump_record", str(tmp_path),
                           "custom/dumps"], cwd=tmp_path, env=own_wandb_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    _recorded(tmp_path, "custom/dumps")
    [run] = wandb_history.read_runs(tmp_path / "wandb", wait=120)
    assert run.config[DUMP_FOLDER_KEY] == "custom/dumps"
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    [experiment] = [e for e in client.search_experiments() if e.name == "dumps"]
    [mlrun] = client.search_runs([experiment.experiment_id])
    assert mlrun.data.params[DUMP_FOLDER_KEY] == "custom/dumps"


@pytest.mark.parametrize("dump_folder, recorded", [
    ("runs/{run_name}/dumps", "dumps"),  # repeats the run folder: taken as runs/plain/dumps
    ("/ELSEWHERE/{run_name}", "/ELSEWHERE/plain"),  # absolute: as written
])
def test_the_record_names_the_folder_the_dumps_are_in(tmp_path, monkeypatch, dump_folder,
                                                      recorded):
    elsewhere = (tmp_path / "elsewhere").as_posix()
    monkeypatch.chdir(tmp_path)
    _train(tmp_path, dump_folder.replace("/ELSEWHERE", elsewhere), every_sink=False)
    _recorded(tmp_path, recorded.replace("/ELSEWHERE", elsewhere))


def test_no_dump_steps_no_record():
    """Without dump steps nothing is dumped, and no folder is named."""
    from composer.loggers import InMemoryLogger

    from foundry_fp8.composer.stats import FP8Stats
    from tests.test_lint_callback_run import _trainer

    memory = InMemoryLogger()
    trainer = _trainer(Path("."), [FP8Stats(interval="1ba", dump_folder="custom")], [memory])
    trainer.fit()
    trainer.close()
    assert DUMP_FOLDER_KEY not in memory.hyperparameters


if __name__ == "__main__":
    _train(Path(sys.argv[1]), sys.argv[2])
