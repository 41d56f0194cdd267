"""`fp8_state_from_checkpoint` pointed at a file that is no Composer checkpoint, as a user
mistypes it: the run folder's hparams.json, an fp8_stats dump, a gzipped checkpoint, a text file,
a torch file of another layout. Before, the first three were refused as "its pickle could run
code" (torch's weights-only reader names any byte it does not know, `Unsupported operand 123`
for JSON's `{`, and that line was taken for the code refusal), the text file raised torch's
`KeyError: 101` and the other layouts an `AttributeError`: tracebacks, not one line."""

from __future__ import annotations

import gzip
import json
import os
import threading

import pytest
import torch
from safetensors.torch import save_file

from foundry_fp8.composer.state import FP8StateError, fp8_state_from_checkpoint


def _checkpoint(path, modules):
    torch.save({"state": {"callbacks": {"FP8State": {"modules": modules}}}}, path)
    return path


@pytest.mark.parametrize("kind, byte", [("json", ord("{")), ("safetensors", None),
                                        ("gzip", 0x1F)])
def test_a_file_of_another_format_is_unreadable_not_code(tmp_path, kind, byte):
    path = tmp_path / f"file.{kind}"
    if kind == "json":
        path.write_text(json.dumps({"fp8/dump_folder": "fp8_dumps"}))
    elif kind == "safetensors":
        save_file({"a": torch.ones(2)}, str(path))
        byte = path.read_bytes()[0]  # the first byte of the header's length
    else:
        path.write_bytes(gzip.compress(_checkpoint(tmp_path / "ck.pt", {}).read_bytes()))
    with pytest.raises(FP8StateError) as raised:
        fp8_state_from_checkpoint(path)
    assert str(raised.value) == (f"fp8_state: {path}: not a readable checkpoint (not a file "
                                 f"torch.save wrote: Unsupported operand {byte})")


def test_a_text_file_is_one_line(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("hello\n")
    with pytest.raises(FP8StateError, match=r"notes\.pt: not a readable checkpoint \(") as raised:
        fp8_state_from_checkpoint(path)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("saved, said", [
    ([1, 2], "the file holds a list"),
    ({"state": 3}, "state holds a int"),
    ({"state": {"callbacks": ["FP8State"]}}, "state.callbacks holds a list")])
def test_a_torch_file_of_another_layout_is_one_line(tmp_path, saved, said):
    path = tmp_path / "other.pt"
    torch.save(saved, path)
    with pytest.raises(FP8StateError) as raised:
        fp8_state_from_checkpoint(path)
    assert str(raised.value) == (f"fp8_state: {path}: not a Composer checkpoint ({said}, not a "
                                 "mapping)")


def test_a_composer_checkpoint_still_reads(tmp_path):
    scale = torch.tensor([2.0, 3.0, 1.0])
    path = _checkpoint(tmp_path / "ck.pt", {"m": {"fwd_scale": scale}})
    assert torch.equal(fp8_state_from_checkpoint(path)["m"]["fwd_scale"], scale)


def _close_a_reader(path, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO while none reads
        except OSError:
            continue


@pytest.mark.parametrize("kind, said", [("fifo", "a FIFO (named pipe)"), ("folder", "a folder")])
def test_a_fifo_or_a_folder_is_refused_unopened(tmp_path, kind, said):
    """A FIFO: torch.load opened it and waited for a writer forever (a hang, not a line); a
    folder (a sharded checkpoint's) said IsADirectoryError."""
    path = tmp_path / "ep0-ba4-rank0.pt"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    stop = threading.Event()
    # a reader waiting on the FIFO (the old code) gets a writer that closes at once, so a
    # regression fails on the message instead of hanging the suite
    unblock = threading.Thread(target=_close_a_reader, args=(path, stop), daemon=True)
    unblock.start()
    try:
        with pytest.raises(FP8StateError) as raised:
            fp8_state_from_checkpoint(path)
    finally:
        stop.set()
        unblock.join()
    assert str(raised.value) == f"fp8_state: {path}: {said}, not a checkpoint file"
