"""Our writes stay in the run folder: a relative `jsonl` path or `dump_folder` is taken inside it
(not in the working directory), `..` out of it is refused in one line, an absolute path is used
as written, and `{run_name}` cannot move a file (`run_name: ../x`). Real Composer Trainers."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from composer import Trainer
from composer.models import ComposerClassifier
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from foundry_fp8.composer.jsonl_logger import JSONLLogger
from foundry_fp8.composer.stats import FP8Stats
from foundry_fp8.jsonl import read_jsonl
from foundry_fp8.paths import PathError, in_run_folder, run_folder, safe_run_name


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """The working directory: a folder that must stay empty."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _train(run_name: str, loggers, callbacks=(), save_folder: str | None = None,
           linears: int = 1) -> Trainer:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,)))
    layers = [nn.Linear(8, 8) for _ in range(linears - 1)] + [nn.Linear(8, 2)]
    model = ComposerClassifier(nn.Sequential(*layers), num_classes=2)
    trainer = Trainer(model=model, optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
                      train_dataloader=DataLoader(data, batch_size=4), max_duration="2ba",
                      loggers=loggers, callbacks=list(callbacks), run_name=run_name,
                      progress_bar=False, log_to_console=False, save_folder=save_folder,
                      save_interval="2ba")
    trainer.fit()
    return trainer


def test_relative_paths_go_into_the_run_folder_not_the_working_directory(tmp_path, elsewhere,
                                                                          capsys):
    save_folder = str(tmp_path / "runs" / "{run_name}" / "checkpoints")
    stats = FP8Stats(interval=10, dump_steps=[1], dump_folder="dumps/{run_name}")
    _train("r", [JSONLLogger(path="logs/metrics.jsonl")], [stats], save_folder)
    run = tmp_path / "runs" / "r"
    assert [step for step, _ in read_jsonl(run / "logs" / "metrics.jsonl")]
    assert (run / "logs" / "hparams.json").exists()
    dump = run / "logs" / "dumps" / "r" / "step0000001-rank0.safetensors"
    tensors = [key for key in load_file(dump) if not key.endswith("/scale")]
    assert len(tensors) == 3  # the one Linear's activation, weight and gradient
    # the console names the file where the user looks, once, at the step it is written, and
    # how many tensors it holds
    said = [line for line in capsys.readouterr().out.splitlines() if "saved to" in line]
    assert said == [f"foundry_fp8 fp8_stats: step 1's 3 tensors saved to {dump}, each with its "
                    "scale (each rank writes its own; the file's metadata says what each tensor "
                    "is)"]
    assert _files(elsewhere) == []


def test_a_dump_layers_regex_that_selects_no_layer_is_said_at_fit_start_and_writes_nothing(
        tmp_path, elsewhere, capsys, caplog):
    """`^0$` (the Sequential's index) is searched in the module name, `module.0`
    (ComposerClassifier's `module`): no layer. One warning at fit start naming the names it is
    searched in; no empty file and no "saved to" line at the dump step."""
    stats = FP8Stats(interval=10, dump_steps=[1], dump_layers="^0$", dump_folder="dumps")
    with caplog.at_level(logging.WARNING, logger="foundry_fp8"):
        trainer = _train("r", [JSONLLogger()], [stats], str(tmp_path / "runs" / "r"))
    names = [name for name, module in trainer.state.model.named_modules()
             if isinstance(module, nn.Linear)]
    assert names == ["module.0"]
    said = [r.getMessage() for r in caplog.records if "dump_layers" in r.getMessage()]
    assert said == ["callbacks.fp8_stats.dump_layers: '^0$' matches none of the 1 watched "
                    "layers, so dump_steps [1] save nothing (fix: a regex that re.search finds "
                    "in their full module names, as layers is: module.0)"]
    assert not (tmp_path / "runs" / "r" / "dumps").exists()
    assert "saved to" not in capsys.readouterr().out


@pytest.mark.parametrize("option", ["layers", "exclude"])
def test_a_dump_layers_regex_matching_only_an_unwatched_layer_names_it_and_the_option(
        tmp_path, elsewhere, caplog, option):
    """`dump_layers: module\\.1` is right, but `layers: module\\.0` (or `exclude: module\\.1`)
    left `module.1` out of the watched set: the fit-start warning names that layer and the
    option, with the patterns as written in YAML (one backslash), not a regex to fix."""
    narrowing = {"layers": {"layers": r"module\.0"}, "exclude": {"exclude": r"module\.1"}}[option]
    stats = FP8Stats(interval=10, dump_steps=[1], dump_layers=r"module\.1", dump_folder="dumps",
                     **narrowing)
    with caplog.at_level(logging.WARNING, logger="foundry_fp8"):
        trainer = _train("r", [JSONLLogger()], [stats], str(tmp_path / "runs" / "r"), linears=2)
    names = [name for name, module in trainer.state.model.named_modules()
             if isinstance(module, nn.Linear)]
    # Python's own re: the one Linear dump_layers finds, and the option that drops it
    [wanted] = [name for name in names if re.search(r"module\.1", name)]
    [pattern] = narrowing.values()
    assert (re.search(pattern, wanted) is None) == (option == "layers")
    said = [r.getMessage() for r in caplog.records if "dump_layers" in r.getMessage()]
    assert said == [f"callbacks.fp8_stats.dump_layers: 'module\\.1' matches none of the 1 "
                    f"watched layers, so dump_steps [1] save nothing: it matches {wanted}, which "
                    f"{option} '{pattern}' left out of the watched layers (fix: widen "
                    "layers/exclude to watch them)"]
    assert not (tmp_path / "runs" / "r" / "dumps").exists()


def test_without_a_local_save_folder_the_run_folder_is_runs_run_name(elsewhere):
    _train("r", [JSONLLogger()])
    assert _files(elsewhere) == ["runs/r/hparams.json", "runs/r/metrics.jsonl"]


@pytest.mark.parametrize("run_name", ["../x", "..", "a/../../b", "/etc/x"])
def test_run_name_cannot_move_a_file(tmp_path, elsewhere, run_name):
    """`logs/{run_name}/...`: a path that begins with `{run_name}` repeats the run folder's last
    part and is taken inside it as the rest (tests/test_paths_cwd.py), filling nothing in."""
    _train(run_name, [JSONLLogger(path="logs/{run_name}/metrics.jsonl")])
    [written] = [p for p in _files(tmp_path) if p.endswith("metrics.jsonl")]
    folder = elsewhere / "runs" / safe_run_name(run_name)
    expected = folder / "logs" / safe_run_name(run_name) / "metrics.jsonl"
    assert Path(written) == expected.relative_to(tmp_path)
    assert "/" not in safe_run_name(run_name) and set(safe_run_name(run_name)) != {"."}


@pytest.mark.parametrize("path", ["../metrics.jsonl", "a/../../m.jsonl", "..", "{run_name}/../../m"])
def test_a_relative_path_out_of_the_run_folder_is_refused_when_the_logger_is_built(path):
    with pytest.raises(ValueError) as error:
        JSONLLogger(path=path)
    assert str(error.value).startswith("loggers.jsonl.path: ") and "\n" not in str(error.value)
    assert "leads out of the run folder" in str(error.value)


def test_a_dump_folder_out_of_the_run_folder_is_refused_when_built():
    with pytest.raises(ValueError, match=r"^callbacks\.fp8_stats\.dump_folder: '\.\./d' leads "
                                         r"out of the run folder"):
        FP8Stats(interval=10, dump_steps=[1], dump_folder="../d")


@pytest.mark.parametrize("template", ["{run_name:d}", "{run_name!r}", "x/{run_name:>20}",
                                      "a}b", "{run_name"])
def test_a_placeholder_not_written_as_is_is_refused_in_one_line_naming_the_key(template):
    """`{run_name}` is filled as one folder name: a format spec raised a ValueError naming no
    key (`:d` on a string), a conversion put quotes into the folder name (`!r`)."""
    for build, key in ((lambda: JSONLLogger(path=template), "loggers.jsonl.path"),
                       (lambda: FP8Stats(dump_folder=template), "callbacks.fp8_stats.dump_folder")):
        with pytest.raises(ValueError) as error:
            build()
        message = str(error.value)
        assert message.startswith(f"{key}: ") and "\n" not in message, message
        assert "a placeholder takes no conversion or format spec (fix: use {run_name} as is)" \
            in message or "is not a valid path template" in message


def test_the_linter_says_it_in_one_line_with_file_line_and_key(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text('loggers:\n  jsonl: {path: "{run_name:d}"}\n'
                    'callbacks:\n  fp8_stats: {dump_folder: "d/{run_name!r}"}\n')
    result = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "lint", str(path),
                             "--format", "json"], capture_output=True, text=True)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    found = sorted((f["rule"], f["line"], f["key"]) for f in json.loads(result.stdout)["files"][0][
        "findings"])
    assert found == [("FP8023", 2, "loggers.jsonl.path"),
                     ("FP8023", 4, "callbacks.fp8_stats.dump_folder")]


def test_the_linter_refuses_it_too():
    from foundry_fp8.lint.rules import lint_config

    findings = [f for f in lint_config({"loggers": {"jsonl": {"path": "../../m.jsonl"}}})
                if "leads out of the run folder" in f.message]
    assert len(findings) == 1 and findings[0].severity == "error"


@pytest.mark.parametrize(("path", "problem"), [
    (".", "is the run folder itself, not a file in it"),
    ("./", "is the run folder itself, not a file in it"),
    ("x/..", "is the run folder itself, not a file in it"),
    ("{run_name}/..", "is the run folder itself, not a file in it"),
    ("logs/", "names a folder, not a file"),
    ("logs/.", "names a folder, not a file"),
    ("/", "names a folder, not a file"),
    ("/tmp/x/..", "names a folder, not a file")])
def test_a_jsonl_path_that_names_no_file_is_refused_in_one_line(path, problem, elsewhere):
    """`path: .` wrote the metrics into a file named like the run folder and hparams.json into
    `runs/`, shared by every such run; `/` crashed the Trainer's constructor with a traceback."""
    from foundry_fp8.lint.rules import lint_config

    with pytest.raises(ValueError) as error:
        JSONLLogger(path=path)
    assert str(error.value) == (f"loggers.jsonl.path: {path!r} {problem} (fix: a file inside the "
                                "run folder, or an absolute file path)")
    [finding] = [f for f in lint_config({"loggers": {"jsonl": {"path": path}}})
                 if f.key == "loggers.jsonl.path"]
    assert finding.severity == "error" and problem in finding.message
    assert _files(elsewhere) == []


def test_a_dump_folder_may_be_the_run_folder_itself(tmp_path, elsewhere):
    """A folder option may name the run folder (`.`); only the jsonl path must name a file."""
    save_folder = str(tmp_path / "runs" / "{run_name}" / "checkpoints")
    stats = FP8Stats(interval=10, dump_steps=[1], dump_folder=".")
    _train("r", [JSONLLogger()], [stats], save_folder)
    assert (tmp_path / "runs" / "r" / "step0000001-rank0.safetensors").exists()


def test_a_run_folder_under_a_file_is_named_in_the_warning(tmp_path, elsewhere, caplog):
    """A save_folder under a regular file: the warning names that file (the OS says only "File
    exists" about the metrics file's own path). Composer's checkpoint saver then fails on the
    same file, after this warning."""
    (tmp_path / "afile").write_text("")
    with caplog.at_level(logging.WARNING), pytest.raises(NotADirectoryError):
        Trainer(model=ComposerClassifier(nn.Sequential(nn.Linear(8, 2)), num_classes=2),
                loggers=[JSONLLogger()], run_name="r", progress_bar=False,
                save_folder=str(tmp_path / "afile" / "checkpoints"))
    [warning] = [r.getMessage() for r in caplog.records if "jsonl logger" in r.getMessage()]
    assert warning.startswith(f"jsonl logger: cannot write {tmp_path / 'afile' / 'metrics.jsonl'}"
                              f" (a parent of it, {tmp_path / 'afile'}, is a file; "), warning


def test_in_run_folder_refuses_a_path_out_of_it():
    with pytest.raises(PathError, match=r"^k: '\.\./x' leads out of the run folder"):
        in_run_folder("../x", Path("/runs/r"), "r", "k")


def test_an_absolute_path_is_used_as_written(tmp_path, elsewhere):
    target = tmp_path / "anywhere" / "{run_name}.jsonl"
    stats = FP8Stats(interval=10, dump_steps=[1], dump_folder=str(tmp_path / "abs-dumps"))
    _train("r", [JSONLLogger(path=str(target))], [stats])
    assert (tmp_path / "anywhere" / "r.jsonl").exists()
    assert (tmp_path / "abs-dumps" / "step0000001-rank0.safetensors").exists()
    assert _files(elsewhere) == []


def test_the_rule():
    folder = Path("/runs/r")
    assert in_run_folder("a/{run_name}/m", folder, "x/y", "k") == folder / "a" / "x_y" / "m"
    assert in_run_folder("a/../m", folder, "r", "k") == folder / "a/../m"  # stays inside
    assert in_run_folder("/abs/../m", folder, "r", "k") == Path("/abs/../m")
    assert run_folder("s3://bucket/ckpt", "r") == Path("runs/r")
    assert run_folder("/x/{rank}/ckpt", "r") == Path("/x/{rank}")
    assert run_folder(None, "..") == Path("runs/__")
    assert safe_run_name("my run-1.2") == "my run-1.2"  # what Composer makes of it too
    assert os.sep == "/"
