"""`JsonlSink` after an append the OS refused at the flush (a full disk, a file-size limit): the
next record still reads the file as the one it wrote to. Before, the sink noted the file's new
size before its close flushed the line, so the next record found the file shorter than noted
and took it for one removed, moved or replaced."""

from __future__ import annotations

import errno
import resource
import signal

import pytest

from foundry_fp8.jsonl import JsonlSink, read_jsonl


def test_a_refused_append_leaves_the_file_the_same_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    assert sink.write(0, {"loss": 1.0})
    size = path.stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal
    try:
        # the OS takes 10 bytes of the line, then refuses the rest: the flush at close fails
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, hard))
        with pytest.raises(OSError) as refused:
            sink.write(1, {"loss": 0.5, "padding": "x" * 100})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert refused.value.errno == errno.EFBIG
    assert path.stat().st_size == size + 10  # what the OS took of the line
    assert sink.write(2, {"loss": 0.25})  # before: False, "removed, moved or replaced"
    skipped: list[int] = []
    records = list(read_jsonl(path, skipped))
    assert [step for step, _ in records] == [0, 2]
    assert skipped == [2]  # the cut line, on a line of its own
