"""The suite's own hygiene: an LLM-Foundry run that stops mid-epoch leaves MosaicML streaming's
download threads polling; `conftest.stop_streaming_threads` ends them after each test (they
slowed every later test of a long pytest)."""

from __future__ import annotations

import sys
import time

from tests.conftest import stop_streaming_threads
from tests.tiny_run import run_tiny

POLLERS = {"_prepare_thread", "_ready_thread"}


def _polling() -> int:
    """Threads now inside streaming's per-epoch download or ready loop."""
    count = 0
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name in POLLERS and "streaming" in frame.f_code.co_filename:
                count += 1
                break
            frame = frame.f_back
    return count


def test_a_run_stopped_mid_epoch_leaves_no_streaming_thread_polling(tmp_path, tiny_data):
    stop_streaming_threads()  # what earlier tests left, if the hook did not run
    run_tiny(tmp_path, tiny_data, {"max_duration": "2ba", "eval_interval": "2ba"})
    assert _polling() >= 2  # the train loader's epoch was left after 2 batches
    assert stop_streaming_threads() >= 1
    deadline = time.monotonic() + 10
    while _polling() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _polling() == 0
    assert stop_streaming_threads() == 0  # each iterator told once, its hook dropped
