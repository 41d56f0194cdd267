"""`foundry-fp8 tiny-data` on what a killed or broken earlier build leaves (QA 6, 7, 10): a build
is called ready only when each split's MDS index parses and names shards that are there at their
size; a partly written build is rebuilt, deleting only the MDS files it wrote under ROOT; a build
another process holds the lock on is waited for with one line saying so, and a whole one is
reused without waiting. Each case starts from a copy of the session's tiny data."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foundry_fp8.cli import main
from foundry_fp8.tools import tiny_data as td

CLI = [sys.executable, "-m", "foundry_fp8.cli"]
SPLITS = ("train", "val")


@pytest.fixture()
def whole(tiny_data, tmp_path) -> td.TinyData:
    """A copy of a whole build (marker included) under tmp_path/data."""
    root = tmp_path / "data"
    root.mkdir()
    for name in (tiny_data.tokenizer_dir.name, tiny_data.data_dir.name):
        shutil.copytree(tiny_data.root / name, root / name)
    for marker in tiny_data.root.glob("ready-*.json"):
        shutil.copy(marker, root / marker.name)
    return td.TinyData(root.resolve(), tiny_data.vocab_size, tiny_data.num_samples)


def _index(data: td.TinyData, split: str) -> Path:
    return data.data_dir / split / "index.json"


def _loadable(data: td.TinyData) -> bool:
    """What a StreamingDataset needs of each split, checked apart from tiny-data's own check:
    the index parses and each shard it names is there at its size."""
    for split in SPLITS:
        try:
            shards = json.loads(_index(data, split).read_text())["shards"]
        except (OSError, ValueError, KeyError):
            return False
        for shard in shards:
            raw = data.data_dir / split / shard["raw_data"]["basename"]
            if not raw.is_file() or raw.stat().st_size != shard["raw_data"]["bytes"]:
                return False
    return True


def _shard(data: td.TinyData, split: str = "val") -> Path:
    return data.data_dir / split / "shard.00000.mds"


@pytest.mark.parametrize(("damage", "says"), [
    (lambda d: _index(d, "val").write_text(""), "val/index.json: not an MDS index"),
    (lambda d: _index(d, "val").write_text(_index(d, "val").read_text()[:100]),
     "val/index.json: not an MDS index"),
    (lambda d: _index(d, "train").write_text('{"shards": []}'), "train/index.json: names no shard"),
    (lambda d: _shard(d).unlink(), "val/shard.00000.mds: missing (val/index.json names it)"),
    (lambda d: os.truncate(_shard(d), 1000), "val/shard.00000.mds: 1000 bytes, where "
                                             "val/index.json names "),
], ids=["empty-index", "cut-index", "no-shard-named", "shard-missing", "shard-cut"])
def test_a_broken_index_or_shard_is_no_whole_build(whole, damage, says):
    assert td._unusable(whole) is None
    damage(whole)
    problem = td._unusable(whole)
    assert problem is not None and says in problem.replace(f"{whole.data_dir}/", "")


@pytest.mark.parametrize("leftover", ["shard-without-index", "empty-index-with-marker"])
def test_a_partly_written_build_is_rebuilt(whole, capsys, leftover):
    """What a kill during MDSWriter leaves (a shard, no index.json), or a ready build whose
    index a crash emptied: rebuilt, exit 0, and then whole."""
    if leftover == "shard-without-index":
        _index(whole, "val").unlink()
        next(whole.root.glob("ready-*.json")).unlink()
    else:
        _index(whole, "train").write_text("")
    assert main(["tiny-data", str(whole.root)]) == 0, capsys.readouterr().err
    assert _loadable(whole) and td._unusable(whole) is None


def test_a_rebuild_deletes_nothing_but_the_mds_files_it_wrote(whole, tmp_path, capsys):
    """A file of someone else's in a split folder, or a split folder that is a link out of
    ROOT, stops the rebuild in one line naming it; nothing of theirs is deleted."""
    _index(whole, "val").unlink()
    notes = whole.data_dir / "val" / "notes.txt"
    notes.write_text("mine")
    assert main(["tiny-data", str(whole.root)]) == 2
    assert capsys.readouterr().err == (
        f"foundry-fp8 tiny-data: {notes}: not a file tiny-data writes, in a dataset folder it "
        "must rebuild (move it away, or build in another ROOT)\n")
    assert notes.read_text() == "mine" and _shard(whole).exists()

    elsewhere = tmp_path / "elsewhere"
    shutil.move(whole.data_dir / "val", elsewhere)
    (elsewhere / "notes.txt").unlink()
    (whole.data_dir / "val").symlink_to(elsewhere)
    assert main(["tiny-data", str(whole.root)]) == 2
    assert capsys.readouterr().err == (
        f"foundry-fp8 tiny-data: {whole.data_dir / 'val'}: leads out of {whole.root} (a symbolic "
        "link); tiny-data rebuilds only folders it made there (remove it, or build in another "
        "ROOT)\n")
    assert (elsewhere / "shard.00000.mds").exists()


# ---- another build holding the lock (QA 10) -------------------------------------------------

def _held(root: Path):
    from filelock import FileLock

    return FileLock(str(root / ".build.lock"))


def _stderr_line(process: subprocess.Popen, seconds: float) -> str:
    """The next line `process` writes to stderr, or '' when none comes within `seconds`."""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stderr, selectors.EVENT_READ)
        if not selector.select(timeout=seconds):
            return ""
    return process.stderr.readline()


def test_a_whole_build_is_reused_while_another_process_holds_the_lock(whole):
    with _held(whole.root):
        done = subprocess.run([*CLI, "tiny-data", str(whole.root)], capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_waiting_build_says_what_it_waits_for_and_then_reuses_the_other_s(whole):
    """Two builds at once: the second waits, saying so once on stderr, and once the first
    released the lock finds its build whole and does not build again."""
    marker = next(whole.root.glob("ready-*.json"))
    marker.unlink()  # as while the other process builds
    shard = _shard(whole).stat().st_ino
    with _held(whole.root):
        process = subprocess.Popen([*CLI, "tiny-data", str(whole.root)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            line = _stderr_line(process, 90)
            assert line == (f"foundry-fp8 tiny-data: waiting for another tiny-data build in "
                            f"{whole.root} to finish (it holds {whole.root / '.build.lock'}) "
                            "...\n")
            time.sleep(1)
            assert process.poll() is None  # still waiting
            marker.write_text("{}")  # the other build is done
        except BaseException:
            process.kill()
            process.communicate()
            raise
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0 and stderr == "", stderr
    assert _shard(whole).stat().st_ino == shard  # not built again


def test_an_empty_root_or_a_device_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    """QA: `foundry-fp8 tiny-data ""` (a `$DATA` left unset) built into the current folder, and
    `tiny-data /dev/null` called the device "a file"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["tiny-data", ""])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "foundry-fp8 tiny-data: error: argument ROOT: empty; give the folder to build into "
        "(default: ./data)")
    assert list(tmp_path.iterdir()) == []
    assert main(["tiny-data", os.devnull]) == 2
    assert capsys.readouterr().err == (
        f"foundry-fp8 tiny-data: {os.devnull}: is a character device, where tiny-data needs a "
        "folder (move it away, or build in another ROOT)\n")


def test_a_fresh_build_prints_its_lines_and_nothing_else(tmp_path):
    """The tokenizer trainer's progress bars (written by its Rust core to the process's stdout,
    blank lines when that is no terminal) stay out of what tiny-data prints."""
    done = subprocess.run([*CLI, "tiny-data", str(tmp_path / "data")], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["building", "tokenizer:", "dataset:"], lines


def test_the_yaml_it_prints_loads_as_the_folders_it_built(whole, tmp_path, capsys):
    """QA 17: under a ROOT with `: ` and ` #` in its name, the printed `{name: ...}` snippets
    loaded as another path (YAML cut the value at ` #`); YAML's own loader must give back the
    folders that were built."""
    import yaml

    root = tmp_path / "runs: #1"
    whole.root.rename(root)
    assert main(["tiny-data", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    tokenizer = yaml.safe_load(lines[-2].split("(tokenizer: ", 1)[1][:-1])
    loader = yaml.safe_load(lines[-1].split("(train_loader: ", 1)[1][:-1])
    assert Path(tokenizer["name"]) == (root / whole.tokenizer_dir.name).resolve()
    assert Path(loader["dataset"]["local"]) == (root / whole.data_dir.name).resolve()
    assert loader["dataset"]["split"] == "train" and loader["name"] == "text"
