"""`foundry-fp8 report RUN_FOLDER`: the FP8 health of a run, per layer and tensor, in markdown.

Reads the run's `metrics.jsonl` (written by the `jsonl` logger) and keeps, for every layer and
tensor, the worst value seen of each statistic. Plain Python: no torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from foundry_fp8.jsonl import read_jsonl

# statistic -> whether larger is worse
WORST = {"underflow_pct": True, "overflow_pct": True, "mse": True, "cos_sim": False, "amax": True}


def worst_stats(metrics_file: Path) -> dict[tuple[str, str], dict[str, float]]:
    """(layer, tensor) -> worst value of each statistic in WORST over all logged steps."""
    table: dict[tuple[str, str], dict[str, float]] = {}
    for _, metrics in read_jsonl(metrics_file):
        for name, value in metrics.items():
            parts = name.split("/")
            if len(parts) != 4 or parts[0] != "fp8" or parts[3] not in WORST or value != value:
                continue  # NaN statistics are counted by nan_count, not ranked here
            row = table.setdefault((parts[1], parts[2]), {})
            pick = max if WORST[parts[3]] else min
            row[parts[3]] = pick(row.get(parts[3], value), value)
    return table


def render(table: dict[tuple[str, str], dict[str, float]]) -> str:
    header = "| layer | tensor | " + " | ".join(WORST) + " |"
    lines = [header, "|" + "---|" * (len(WORST) + 2)]
    for (layer, tensor), row in sorted(table.items(), key=lambda kv: -kv[1].get("underflow_pct", 0)):
        values = " | ".join(f"{row.get(k, float('nan')):.4g}" for k in WORST)
        lines.append(f"| {layer} | {tensor} | {values} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_folder", type=Path, help="folder holding the run's metrics.jsonl")


def run(args: argparse.Namespace) -> int:
    metrics_file = args.run_folder / "metrics.jsonl"
    if not metrics_file.exists():
        print(f"error: {metrics_file}: not found (was the `jsonl` logger in the YAML?)")
        return 2
    table = worst_stats(metrics_file)
    if not table:
        print(f"error: {metrics_file}: no fp8/ metrics (was `fp8_stats` in the YAML?)")
        return 2
    out = args.run_folder / "fp8_report.md"
    out.write_text("# FP8 health (worst value per layer and tensor)\n\n" + render(table))
    print(render(table))
    print(f"written to {out}")
    return 0
