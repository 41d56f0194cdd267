"""A sweep against one baseline whose step ranges do not match (QA s23): a run that shares no
loss step with the baseline read `loss gap +nan % (last 0 compared steps)` in the summary, a
NaN that the report elsewhere uses for a NaN/Inf loss."""

from __future__ import annotations

from pathlib import Path

from foundry_fp8.cli import main
from foundry_fp8.health.keys import LOSS, layer_key
from foundry_fp8.jsonl import JsonlSink


def _run(folder: Path, steps: range, loss: float, fp8: bool = True) -> Path:
    sink = JsonlSink(folder / "metrics.jsonl")
    for step in steps:
        sink.write(step, {LOSS: loss, **({layer_key("underflow_pct", "weight", "blocks.0.fc"):
                                           0.1} if fp8 else {})})
    return folder


def test_a_sweep_run_sharing_no_step_with_the_baseline_says_so(tmp_path, capsys):
    bf16 = _run(tmp_path / "bf16", range(0, 101), 2.0, fp8=False)
    early = _run(tmp_path / "early", range(0, 30), 2.02)  # steps 0-29: all compared
    late = _run(tmp_path / "late", range(500, 530), 2.02)  # resumed far past the baseline
    assert main(["report", str(early), str(late), "--baseline", str(bf16)]) == 0
    out = capsys.readouterr().out
    summary = out[out.index("2 runs:\n"):]
    assert summary == (
        "2 runs:\n"
        f"  {early}: 0 flagged, loss gap +1 % (last 3 compared steps)\n"
        f"  {late}: 0 flagged, no loss step shared with the baseline (this run's loss ends at "
        "step 529, the baseline's at 100)\n"), summary
