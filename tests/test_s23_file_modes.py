"""Files we create get the mode a plain open() gives (0o666 less the umask), as Composer's
checkpoints and every other file of the run do: on a shared cluster other users, or a job's
other uid reading the run folder, read them. QA s23: fp8_stats' dumps were 0600, safetensors'
`save_file` writing a temporary file (Rust's tempfile: 0600) and renaming it. Modes are read
back with `os.stat` under a known umask."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from foundry_fp8.jsonl import (
    JsonlSink,
    claim_numbered,
    lock_writer,
    numbered,
    set_aside,
    set_plain_mode,
    unlock_writer,
    write_atomically,
    write_output,
)

UMASKS = {0o027: 0o640, 0o002: 0o664}  # umask: the mode a plain open() gives


@pytest.fixture(params=sorted(UMASKS), ids=oct)
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_file_safetensors_wrote_0600_gets_the_plain_mode(tmp_path, umask):
    path = tmp_path / "step0000001-rank0.safetensors"
    save_file({"0/weight": torch.ones(2)}, str(path))
    assert _mode(path) == 0o600  # what this test is about: safetensors' own mode
    set_plain_mode(path)
    assert _mode(path) == UMASKS[umask]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no probe left behind
    assert torch.equal(load_file(path)["0/weight"], torch.ones(2))  # untouched


def test_every_file_the_logger_and_the_report_write_gets_the_plain_mode(tmp_path, umask):
    metrics, hparams = tmp_path / "metrics.jsonl", tmp_path / "hparams.json"
    key = lock_writer(metrics)
    assert isinstance(key, tuple)
    unlock_writer(key)
    JsonlSink(metrics).write(0, {"loss": 1.0})
    write_atomically(hparams, "{}")
    write_output(tmp_path / "fp8_report.md", "# report")
    aside = numbered(metrics, claim_numbered(metrics, hparams))
    set_aside(metrics, 0, aside, lambda _: None)  # a new metrics.jsonl, through a rename
    written = sorted(tmp_path.iterdir())
    assert [p.name for p in written] == ["fp8_report.md", "hparams.json", "metrics.1.jsonl",
                                         "metrics.jsonl"]
    assert {p.name: _mode(p) for p in written} == {p.name: UMASKS[umask] for p in written}
