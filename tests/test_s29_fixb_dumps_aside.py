"""The jsonl logger moves an earlier run's fp8_stats dumps (`jsonl_logger._dumps_aside`) into a
folder that did not exist, and records whatever it moved. Before: a leftover `fp8_dumps/1/`
holding a file of the same name (its metrics.1.jsonl deleted) kept the earlier run's file in
fp8_dumps/, where the new run overwrote it, while hparams.1.json was pointed at the leftover's
file; a move that failed part-way kept the old record, the moved files orphaned."""

from __future__ import annotations

import json
import os
from pathlib import Path

from foundry_fp8.composer import jsonl_logger
from foundry_fp8.paths import DUMP_FOLDER_KEY

NAMES = ("step0000001-rank0.safetensors", "step0000002-rank0.safetensors")


def _dumps(folder: Path, names: tuple[str, ...]) -> str:
    """The earlier run's dumps, each holding its own name; its hparams.json text."""
    (folder / "fp8_dumps").mkdir()
    for name in names:
        (folder / "fp8_dumps" / name).write_text(f"earlier {name}")
    return json.dumps({DUMP_FOLDER_KEY: "fp8_dumps"})


def test_a_leftover_folder_is_neither_overwritten_nor_recorded(tmp_path):
    hparams = _dumps(tmp_path, NAMES[:1])
    leftover = tmp_path / "fp8_dumps" / "1" / NAMES[0]
    leftover.parent.mkdir()
    leftover.write_text("leftover")
    text, said, failed = jsonl_logger._dumps_aside(hparams, tmp_path, 1)
    assert failed is None and json.loads(text)[DUMP_FOLDER_KEY] == "fp8_dumps/1.1"
    assert (tmp_path / "fp8_dumps" / "1.1" / NAMES[0]).read_text() == f"earlier {NAMES[0]}"
    assert leftover.read_text() == "leftover"
    assert not (tmp_path / "fp8_dumps" / NAMES[0]).exists()  # nothing left for the new run
    assert str(tmp_path / "fp8_dumps" / "1.1") in said and "1 fp8_stats dump " in said


def test_a_move_failing_part_way_records_what_moved(tmp_path, monkeypatch):
    hparams = _dumps(tmp_path, NAMES)
    rename, calls = os.rename, []

    def second_fails(src: Path, dst: Path) -> None:
        calls.append(src)
        if len(calls) == 2:
            raise PermissionError(13, "Permission denied", str(src))
        rename(src, dst)

    monkeypatch.setattr(jsonl_logger.os, "rename", second_fails)
    text, said, failed = jsonl_logger._dumps_aside(hparams, tmp_path, 1)
    assert isinstance(failed, PermissionError)
    assert json.loads(text)[DUMP_FOLDER_KEY] == "fp8_dumps/1"  # where the moved file is
    assert (tmp_path / "fp8_dumps" / "1" / NAMES[0]).read_text() == f"earlier {NAMES[0]}"
    assert (tmp_path / "fp8_dumps" / NAMES[1]).is_file()
    assert "1 fp8_stats dump of 2" in said


def test_a_move_failing_at_once_keeps_the_record(tmp_path, monkeypatch):
    hparams = _dumps(tmp_path, NAMES)

    def fails(src: Path, dst: Path) -> None:
        raise OSError(18, "Invalid cross-device link", str(src))

    monkeypatch.setattr(jsonl_logger.os, "rename", fails)
    text, said, failed = jsonl_logger._dumps_aside(hparams, tmp_path, 1)
    assert isinstance(failed, OSError) and text == hparams and said == ""
    assert all((tmp_path / "fp8_dumps" / name).is_file() for name in NAMES)
