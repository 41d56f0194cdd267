"""A relative path that repeats the run folder (`path: runs/{run_name}/metrics.jsonl`, the jsonl
default before a relative path was taken inside the run folder) is taken as the file it named
before, with one warning naming the key, what it would have resolved to and the fix; the linter
says the same at the key's line (FP8052). Real LLM-Foundry and Composer runs."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from composer import Trainer
from composer.models import ComposerClassifier
from omegaconf import OmegaConf as om
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.paths import PathError, in_run_folder
from tests.tiny_run import tiny_config

OLD_DEFAULT = "runs/{run_name}/metrics.jsonl"


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _said(caplog: pytest.LogCaptureFixture, key: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith(f"{key}: ") and "begins with the run folder" in
            r.getMessage()]


@pytest.mark.parametrize(("template", "folder", "expected"), [
    (OLD_DEFAULT, "runs/X", "runs/X/metrics.jsonl"),
    ("./runs/{run_name}/logs/m.jsonl", "runs/X", "runs/X/logs/m.jsonl"),
    ("{run_name}/metrics.jsonl", "X", "X/metrics.jsonl"),  # save_folder: ./{run_name}/ckpt
    ("runs/metrics.jsonl", "runs/X", "runs/X/runs/metrics.jsonl"),  # runs/ alone: no repeat
    ("runs/Y/metrics.jsonl", "runs/X", "runs/X/runs/Y/metrics.jsonl"),  # another run's folder
    ("metrics.jsonl", ".", "metrics.jsonl"),  # the run folder is the working directory
])
def test_a_repeated_run_folder_is_taken_once(tmp_path, monkeypatch, template, folder, expected):
    monkeypatch.chdir(tmp_path)
    got = in_run_folder(template, Path(folder), "X", "loggers.jsonl.path", file=True)
    assert str(got) == expected


def test_an_absolute_run_folder_inside_the_working_directory_is_repeated_alike(tmp_path,
                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = in_run_folder(OLD_DEFAULT, tmp_path / "runs" / "X", "X", "loggers.jsonl.path", True)
    assert got == tmp_path / "runs" / "X" / "metrics.jsonl"


def test_a_file_path_that_is_the_run_folder_itself_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PathError, match=r"^loggers\.jsonl\.path: 'runs/\{run_name\}' is the run "
                       "folder itself"):
        in_run_folder("runs/{run_name}", Path("runs/X"), "X", "loggers.jsonl.path", file=True)


def test_fp8_stats_dumps_under_a_repeated_dump_folder_land_in_the_run_folder(tmp_path,
                                                                           monkeypatch, caplog):
    """No save_folder and no jsonl logger: the run folder is runs/<run_name>."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,)))
    model = ComposerClassifier(nn.Sequential(nn.Linear(8, 2)), num_classes=2)
    stats = FP8Stats(interval=10, dump_steps=[1], dump_folder="runs/{run_name}/dumps")
    with caplog.at_level(logging.WARNING):
        Trainer(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                train_dataloader=DataLoader(data, batch_size=4), max_duration="2ba",
                callbacks=[stats], run_name="r", progress_bar=False,
                log_to_console=False).fit()
    assert _files(tmp_path) == ["runs/r/dumps/step0000001-rank0.safetensors"]
    assert len([k for k in load_file(tmp_path / _files(tmp_path)[0])
                if not k.endswith("/scale")]) == 3
    assert _said(caplog, "callbacks.fp8_stats.dump_folder") == [
        "callbacks.fp8_stats.dump_folder: 'runs/{run_name}/dumps' begins with the run folder "
        "runs/r, inside which a relative path is taken (no longer in the working directory), so "
        "it would write runs/r/runs/r/dumps, apart from the run's other files; taken as "
        "runs/r/dumps, the path it named before (fix: `dump_folder: dumps`)"]


def test_the_old_jsonl_default_written_out_in_a_tiny_llm_foundry_run(tmp_path, monkeypatch,
                                                                   tiny_data, capfd):
    """The YAML of a team that wrote the old default out and keeps LLM-Foundry's default run
    folder (no save_folder): the metrics go to ./runs/<run_name>/metrics.jsonl, where the run's
    first half (before the upgrade) put them; the run says so once; `foundry-fp8 lint` says it
    at the key's line and names the same file."""
    from llmfoundry.command_utils import train

    monkeypatch.chdir(tmp_path)
    cfg = tiny_config(tmp_path, tiny_data, {"loggers": {"jsonl": {"path": OLD_DEFAULT}},
                                            "max_duration": "10ba"})
    del cfg["save_folder"], cfg["save_interval"], cfg["save_overwrite"]
    name = cfg.variables.run_name
    yaml = tmp_path / "train.yaml"
    om.save(cfg, yaml)
    capfd.readouterr()
    train(om.load(yaml))  # LLM-Foundry sets up its own log handler: read what it prints
    printed = capfd.readouterr()
    metrics = tmp_path / "runs" / name / "metrics.jsonl"
    assert [step for step, _ in read_jsonl(metrics)][-1] == 10  # every step, in one file
    assert not (tmp_path / "runs" / name / "runs").exists()
    said = [line.split(": WARNING: foundry_fp8.paths: ", 1)[1]
            for line in (printed.out + printed.err).splitlines()
            if ": WARNING: foundry_fp8.paths: " in line]
    assert said == [
        f"loggers.jsonl.path: '{OLD_DEFAULT}' begins with the run folder runs/{name}, inside "
        "which a relative path is taken (no longer in the working directory), so it would write "
        f"runs/{name}/runs/{name}/metrics.jsonl, apart from the run's other files; taken as "
        f"runs/{name}/metrics.jsonl, the path it named before (fix: `path: metrics.jsonl`)"]

    lint = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", str(yaml)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines = yaml.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.strip() == f"path: {OLD_DEFAULT}")
    column = lines[line - 1].index("path") + 1
    [row] = [r for r in lint.stdout.splitlines() if "FP8052" in r]
    assert row.split()[:4] == [f"{line}:{column}", "warning", "FP8052", "loggers.jsonl.path"]
    assert f"taken as runs/{name}/metrics.jsonl," in row
    assert lint.returncode == 0, lint.stdout + lint.stderr  # a warning: the run is not refused
