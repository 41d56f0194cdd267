"""fp8_stats' dumps get the mode a plain open() gives (0o666 less the umask), as every other
file of the run: QA s23 found them 0600 (safetensors writes a temporary file, Rust's tempfile:
0600, and renames it), so other users of a shared cluster, or a job's other uid, could not read
them. FP8Monitor writes the dump in a plain loop; its mode is read back under a known umask."""

from __future__ import annotations

import os
import stat

from safetensors.torch import load_file

from tests.test_monitor_dumps import _train_steps


def test_a_dump_gets_the_mode_of_a_plain_open(tmp_path):
    old = os.umask(0o027)
    try:
        _train_steps(tmp_path, 2)
    finally:
        os.umask(old)
    [dump] = tmp_path.iterdir()  # no probe left behind
    assert dump.name == "step0000001-rank0.safetensors"
    assert stat.S_IMODE(dump.stat().st_mode) == 0o640
    assert sorted(load_file(dump)) == ["0/activation", "0/activation/scale", "0/gradient",
                                       "0/gradient/scale", "0/weight", "0/weight/scale"]
