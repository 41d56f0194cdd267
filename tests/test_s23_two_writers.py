"""Two runs writing one metrics.jsonl at once, in step (A:0, B:0, A:1, B:1, ...: the same run
name started twice where the file system takes no flock), are named in one warning; before, the
report read them as one run, the record read last at each step winning silently (QA s23, helper
R). A resume at the step its dead attempt logged last, also that step's records twice, and a
crash loop resumed at one checkpoint again and again, are not. Files written with the `jsonl`
logger's own writer, read by `foundry-fp8 report`."""

from __future__ import annotations

from pathlib import Path

from foundry_fp8.cli import main
from foundry_fp8.health.keys import LOSS, layer_key, summary_key
from foundry_fp8.jsonl import JsonlSink
from foundry_fp8.report.read import load_run

INTERVAL = 2  # fp8_stats' logging interval; the loss is logged at every batch
COS = layer_key("cos_sim", "activation", "blocks.0.attn.Wqkv")


def _batch(sink: JsonlSink, step: int, cos_sim: float) -> None:
    """One training batch as a run's loggers write it: fp8_stats' record at its logging steps
    (AFTER_TRAIN_BATCH), then Composer's loss (BATCH_END)."""
    if step % INTERVAL == 0:
        sink.write(step, {COS: cos_sim, summary_key(None, "flagged_layers"): 0.0})
    sink.write(step, {LOSS: 3.0 - step / 100})


def _read(path: Path) -> tuple[dict[int, float], list[str]]:
    warned: list[str] = []
    run, _ = load_run(path, warned.append)
    return run.values[("blocks.0.attn.Wqkv", "activation", "cos_sim")], warned


def test_two_runs_writing_one_file_in_step_are_named(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    first, second = JsonlSink(path), JsonlSink(path)  # two processes' writers, one file
    for step in range(8):
        _batch(first, step, 0.999)
        _batch(second, step, 0.5)
    cos_sim, [warning] = _read(path)
    assert cos_sim == {0: 0.5, 2: 0.5, 4: 0.5, 6: 0.5}  # what the report shows: the later's
    assert warning.startswith(f"{path}: steps 0, 1, 2, 3, 4, ... (3 more) each hold two "
                              "records") and "two runs wrote this file at once" in warning
    assert main(["report", str(tmp_path)]) == 0
    assert "two runs wrote this file at once" in capsys.readouterr().err


def test_a_resume_at_the_dead_attempts_last_step_is_no_second_writer(tmp_path):
    """The dead attempt logged step 4 (fp8_stats and the loss) past its last checkpoint, at
    batch count 4; the resumed attempts log step 4 again: once, then the crash loop twice more."""
    path = tmp_path / "metrics.jsonl"
    attempts = ((0, 5, 0.95), (4, 5, 0.96), (4, 5, 0.97), (4, 8, 0.98))  # from batch 4 on
    for start, stop, cos_sim in attempts:
        sink = JsonlSink(path)
        for step in range(start, stop):
            _batch(sink, step, cos_sim)
    cos_sim, warned = _read(path)
    assert cos_sim == {0: 0.95, 2: 0.95, 4: 0.98, 6: 0.98}
    assert warned == []


def test_a_resume_that_goes_back_is_said_as_before(tmp_path):
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in [*range(7), *range(4, 8)]:  # killed at batch 7, resumed from batch 4
        _batch(sink, step, 0.99)
    _, [warning] = _read(path)
    assert "the steps go back once (step 6 -> 4)" in warning
