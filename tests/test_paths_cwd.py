"""A relative path that repeats the run folder (`dump_folder: runs/{run_name}/dumps`) is
recognized by the run folder's last parts, not by the run folder taken relative to the working
directory: the run, `foundry-fp8 lint` and `foundry-fp8 report` agree from any working directory,
a symlinked one included, and only the run warns (QA 20, R3-20)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from composer import Trainer
from composer.models import ComposerClassifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.cli import main
from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.health.keys import LOSS, layer_key
from foundry_fp8.jsonl import JsonlSink, read_jsonl
from foundry_fp8.lint.cli import lint_file
from foundry_fp8.paths import in_run_folder, repeated_run_folder, say_repeated

OLD_DEFAULT = "runs/{run_name}/metrics.jsonl"
KEY = "loggers.jsonl.path"
LAYERS = ("blocks.0.attn.Wqkv", "blocks.1.attn.Wqkv")


def _run_with_a_dump(project: Path) -> Path:
    """A finished run under `project`/runs/X whose hparams say `dump_folder:
    runs/{run_name}/dumps` (written when the run started in `project`), with fp8_stats' dump at
    step 50, where blocks.0's activation underflows; the dump file's path."""
    run = project / "runs" / "X"
    sink = JsonlSink(run / "metrics.jsonl")
    for step in range(0, 101, 10):
        values = {LOSS: 3.0}
        for layer in LAYERS:
            for tensor in ("activation", "weight", "gradient"):
                bad = step >= 50 and layer == LAYERS[0] and tensor == "activation"
                values[layer_key("underflow_pct", tensor, layer)] = 9.0 if bad else 0.1
        sink.write(step, values)
    (run / "hparams.json").write_text(json.dumps({"run_name": "X", "callbacks": {"fp8_stats": {
        "dump_folder": "runs/{run_name}/dumps", "dump_steps": [50]}}}))
    # a safetensors file as fp8_stats writes it: 8 bytes of header size, the JSON header, data
    header = json.dumps({f"{LAYERS[0]}/activation": {"dtype": "F32", "shape": [1],
                                                     "data_offsets": [0, 4]}}).encode()
    dump = run / "dumps" / "step0000050-rank0.safetensors"
    dump.parent.mkdir()
    dump.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    return dump


@pytest.mark.parametrize("where", ["elsewhere", "symlink", "project", "run folder"])
def test_the_report_links_a_repeated_dump_folder_from_any_working_directory(
        tmp_path, monkeypatch, capsys, where):
    """Before: only from the project folder; from elsewhere (or a symlinked cwd) the report lost
    the dump link and printed the run's warning about `runs/X/runs/X/dumps` on stderr."""
    project = tmp_path / "proj"
    dump = _run_with_a_dump(project)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(project)
    cwd, argument = {"elsewhere": (tmp_path / "elsewhere", str(dump.parents[1])),
                     "symlink": (tmp_path / "link", str(tmp_path / "link" / "runs" / "X")),
                     "project": (project, "runs/X"),
                     "run folder": (dump.parents[1], ".")}[where]
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    assert main(["report", argument]) == 0
    printed = capsys.readouterr()
    [line] = [line for line in printed.out.splitlines() if "fp8_stats' dump of" in line]
    linked = line.split(f"fp8_stats' dump of '{LAYERS[0]}' activation there: ", 1)[1]
    assert os.path.samefile(linked.rstrip("."), dump)
    assert "begins with the run folder" not in printed.err


def test_in_run_folder_says_nothing_the_run_says_it_once(tmp_path, caplog):
    folder = tmp_path / "runs" / "X"
    with caplog.at_level(logging.WARNING):
        assert in_run_folder(OLD_DEFAULT, folder, "X", KEY, file=True) == folder / "metrics.jsonl"
        assert caplog.records == []
        for _ in range(2):
            say_repeated(OLD_DEFAULT, folder, "X", KEY)
    assert [r.getMessage().split(": ", 1)[0] for r in caplog.records] == [KEY]
    assert f"taken as {folder / 'metrics.jsonl'}," in caplog.records[0].getMessage()


def test_an_absolute_save_folder_through_a_symlink_counts(tmp_path, monkeypatch, caplog):
    """`save_folder: /home/u/proj/runs/{run_name}/ckpt` with /home -> /gpfs, run from the
    project folder: the working directory is the physical /gpfs/u/proj, and relpath from it
    never found the run folder, so the metrics went to runs/r/runs/r/metrics.jsonl. A real
    Composer run with our jsonl logger."""
    (tmp_path / "gpfs" / "proj").mkdir(parents=True)
    (tmp_path / "home").symlink_to(tmp_path / "gpfs")
    monkeypatch.chdir(tmp_path / "home" / "proj")
    with caplog.at_level(logging.WARNING):
        _fit("r", OLD_DEFAULT, str(tmp_path / "home" / "proj" / "runs" / "{run_name}" / "ckpt"))
    run = tmp_path / "gpfs" / "proj" / "runs" / "r"
    assert [step for step, _ in read_jsonl(run / "metrics.jsonl")][-1] == 3
    assert not (run / "runs").exists()
    assert sum("begins with the run folder runs/r," in r.getMessage()
               for r in caplog.records) == 1


def _fit(run_name: str, path: str, save_folder: str) -> None:
    """A 3-batch Composer fit with our jsonl logger writing `path`, checkpointing at the end."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,)))
    model = ComposerClassifier(nn.Sequential(nn.Linear(8, 2)), num_classes=2)
    Trainer(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            train_dataloader=DataLoader(data, batch_size=4), max_duration="3ba",
            loggers=[JSONLLogger(path=path)], run_name=run_name, progress_bar=False,
            save_folder=save_folder, save_interval="3ba", log_to_console=False).fit()


def test_lint_and_the_run_agree_from_another_working_directory(tmp_path, monkeypatch):
    """FP8052 with an absolute save_folder was said only where lint ran in the folder above the
    run folder; from elsewhere lint said nothing while the run (from the project) warned."""
    project = tmp_path / "proj"
    project.mkdir()
    yaml = tmp_path / "train.yaml"
    yaml.write_text(f"run_name: exp\nsave_folder: {project}/runs/exp/ckpt\n"
                    "loggers:\n  jsonl:\n    path: runs/exp/metrics.jsonl\n")
    expected = project / "runs" / "exp" / "metrics.jsonl"
    for cwd in (project, tmp_path):
        monkeypatch.chdir(cwd)
        said = [f["message"] for f in lint_file(yaml)["findings"] if f["rule"] == "FP8052"]
        assert len(said) == 1 and f"taken as {expected}," in said[0], (cwd, said)
        got = in_run_folder("runs/exp/metrics.jsonl", project / "runs" / "exp", "exp", KEY, True)
        assert got == expected


def test_a_relative_run_folder_is_matched_on_its_written_parts_only(tmp_path, monkeypatch,
                                                                   caplog):
    """F1-20: run from /work/main with `save_folder: checkpoints` (the run folder `.`), a path
    `main/metrics.jsonl` was matched on the working directory's own last part `main` and
    written to ./metrics.jsonl, with a warning; the old rule (a relative path taken in the
    working directory) and the new one (inside the run folder `.`) both name ./main/. A real
    Composer run with our jsonl logger."""
    (tmp_path / "main").mkdir()
    monkeypatch.chdir(tmp_path / "main")
    old_rule = tmp_path / "main" / "main" / "metrics.jsonl"  # the working directory / the path
    with caplog.at_level(logging.WARNING):
        _fit("r", "main/metrics.jsonl", "checkpoints")
    assert [step for step, _ in read_jsonl(old_rule)][-1] == 3
    assert not (tmp_path / "main" / "metrics.jsonl").exists()
    assert not [r for r in caplog.records if "begins with the run folder" in r.getMessage()]


def test_only_rank_zero_warns_of_a_repeated_run_folder(tmp_path, monkeypatch, caplog):
    """F1-20: every rank warned, once each, before the jsonl logger's rank check; fp8_stats'
    other warnings are rank 0's alone."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("foundry_fp8.composer.jsonl_logger.dist.get_global_rank", lambda: 1)
    state = type("State", (), {"run_name": "rank1", "callbacks": ()})()
    logger = JSONLLogger(path=OLD_DEFAULT)
    with caplog.at_level(logging.WARNING):
        logger.init(state, None)
    assert logger.path == Path("runs", "rank1", "metrics.jsonl")
    assert [r.getMessage() for r in caplog.records] == []


def test_the_working_directory_is_no_part_of_a_relative_run_folder(tmp_path, monkeypatch):
    """F1-20's reproduction: `main/metrics.jsonl` with the run folder `.` in /…/main repeats
    nothing (None), so it is taken as written, ./main/metrics.jsonl; `runs/X/...` with the run
    folder `runs/X` still does, from any working directory."""
    (tmp_path / "main").mkdir()
    monkeypatch.chdir(tmp_path / "main")
    assert repeated_run_folder("main/metrics.jsonl", Path("."), "X", KEY) is None
    got = in_run_folder("main/metrics.jsonl", Path("."), "X", KEY, file=True)
    assert got == Path("main", "metrics.jsonl")
    assert in_run_folder(OLD_DEFAULT, Path("runs/X"), "X", KEY, True) == Path("runs/X/metrics.jsonl")
