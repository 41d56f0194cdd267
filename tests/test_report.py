"""`foundry-fp8 report` keeps the worst value of each statistic per layer and tensor."""

from __future__ import annotations

import subprocess
import sys

from foundry_fp8.jsonl import JsonlSink


def test_report_keeps_worst_values(tmp_path):
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.write(0, {"fp8/blocks.0.up/weight/underflow_pct": 1.0,
                   "fp8/blocks.0.up/weight/cos_sim": 0.999, "loss/train/total": 3.0})
    sink.write(10, {"fp8/blocks.0.up/weight/underflow_pct": 7.5,
                    "fp8/blocks.0.up/weight/cos_sim": 0.98})
    sink.write(20, {"fp8/blocks.0.up/weight/underflow_pct": 2.0,
                    "fp8/blocks.0.up/weight/cos_sim": float("nan")})
    from foundry_fp8.report import worst_stats

    row = worst_stats(tmp_path / "metrics.jsonl")[("blocks.0.up", "weight")]
    assert row["underflow_pct"] == 7.5
    assert row["cos_sim"] == 0.98  # NaN never hides a real bad value
    out = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "report", str(tmp_path)],
                         capture_output=True, text=True, check=True)
    assert "| blocks.0.up | weight | 7.5 |" in out.stdout
    assert (tmp_path / "fp8_report.md").exists()


def test_report_without_fp8_metrics_exits_2(tmp_path):
    JsonlSink(tmp_path / "metrics.jsonl").write(0, {"loss/train/total": 1.0})
    result = subprocess.run([sys.executable, "-m", "foundry_fp8.cli", "report", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "fp8_stats" in result.stdout
