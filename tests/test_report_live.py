"""`foundry-fp8 report` on a metrics.jsonl the run appends to while the report reads it: the
line not finished when read is said in the live-run warning, a killed run's line before it
keeps its own warning."""

from __future__ import annotations

import json

from foundry_fp8.report import read
from foundry_fp8.report.read import load_run

KEY = "fp8_underflow_pct/weight/blocks.0.fc"


def _line(step: int) -> str:
    return json.dumps({"step": step, "metrics": {"loss/train/total": 3.0, KEY: 0.1}}) + "\n"


def test_a_crash_line_in_the_middle_of_a_growing_file_is_not_the_one_being_written(
        tmp_path, monkeypatch):
    """Review 19: with the file grown while read and exactly one line skipped, that line was
    said to be "not finished when read" even when it was a killed attempt's partial line in the
    middle (line 4 here), and its "killed mid-write" warning was dropped."""
    path = tmp_path / "metrics.jsonl"
    crash = '{"step": 3, "metr\n'  # the killed attempt's; the resumed run's sink added "\n"
    path.write_text("".join(map(_line, range(3))) + crash + "".join(map(_line, range(3, 6))))
    assert path.read_text().splitlines(keepends=True).index(crash) + 1 == 4  # the reference
    reader = read.read_jsonl

    def grows(*args: object):  # the writer appends a whole line just after the read
        yield from reader(*args)
        with path.open("a") as f:
            f.write(_line(6))

    monkeypatch.setattr(read, "read_jsonl", grows)
    said: list[str] = []
    run, _ = load_run(path, said.append)
    assert run.steps == [0, 1, 2, 3, 4, 5]
    assert said == [
        f"{path}: grew by {len(_line(6)):,} bytes while the report read it: the run is still "
        "writing it; the report covers what was read, up to step 5",
        f"{path}:4: skipped 1 line that does not decode (line 4; a run killed mid-write leaves "
        "one); the report covers the rest"]

    unfinished = _line(7)[:20]  # now also a line the writer is in the middle of, line 9
    path.write_text(path.read_text() + unfinished)
    said.clear()
    load_run(path, said.append)
    assert said[0].endswith("the report covers what was read (line 9, not finished when read, "
                            "skipped), up to step 6"), said
    assert said[1:] == [f"{path}:4: skipped 1 line that does not decode (line 4; a run killed "
                        "mid-write leaves one); the report covers the rest"]
