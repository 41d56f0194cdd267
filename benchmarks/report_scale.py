"""Wall time, CPU time and peak memory of `foundry-fp8 report` on runs of a real run's size,
from each sink it reads: the `jsonl` logger's metrics.jsonl, a W&B offline run, an MLflow file
store run.

The inputs are not made up: a real run of the tiny MPT (`make run`, or `llmfoundry train
yamls/mpt-tiny-cpu.yaml`: fp8_stats, fp8_guard and Composer's own series, with the jsonl
logger) is scaled up record for record: each step logs the records the real run logged at
one of its steps (the same keys, in the same order), its blocks' series copied to `--blocks`
blocks (values varied by up to 5 %), fp8_stats every `--interval` batches with an
`--debug A:B` stretch at interval 1, and `--resume AT:BACK` attempts that go back to a
checkpoint. hparams.json is the real run's with fp8_stats' layer order
(`health.keys.layer_order_params`) for the blocks. A W&B run is written with W&B's own
`wandb.log` (offline, one attempt per resume, as `resume: allow` does), an MLflow run with
MLflow's own FileStore.log_batch. Files go under `--work` (default: a temporary folder).

A timed test would fail on a loaded machine: the targets are checked here, and the 1-minute
load average is recorded next to each figure.

Targets (MPT-1B-sized: 24 blocks, 96 layers x 3 tensors; 50,000 steps at interval 100 plus
1,000 steps at interval 1, two resumes: 1,490 logging steps, 5.2 million numbers, 390 MB):
peak memory under 1 GiB from metrics.jsonl, under 1.5 GiB from MLflow or W&B (24 GiB
machines report MPT-7B runs of 4x that), CPU time linear in the numbers read (the figure:
microseconds a number, under 60 on one core of a 2020s x86 machine).

    .venv/bin/python benchmarks/report_scale.py --real runs/mpt-tiny-cpu [--sinks jsonl mlflow]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout, not an installed copy
RESULTS = REPO / "benchmarks" / "results"
PARTS = ("attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj")  # MPT's block GEMMs
TARGET_PEAK_MIB = {"jsonl": 1024, "mlflow": 1536, "wandb": 1536}
TARGET_US_PER_NUMBER = 60.0
JITTER = 0.1  # +-5 %


def _real_steps(real: Path) -> dict[int, list[dict[str, Any]]]:
    """The real run's records, step -> its records in file order."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    with (real / "metrics.jsonl").open() as f:
        for line in f:
            record = json.loads(line)
            by_step[record["step"]].append(record["metrics"])
    return by_step


def _scaled(metrics: dict[str, Any], blocks: int, rng: random.Random) -> dict[str, Any]:
    """One record with each per-layer series of block b copied to blocks b, b + n, ... (n: the
    real run's blocks), values varied; cos_sim's distance from 1 is varied, not the value."""
    from foundry_fp8.health.keys import layer_key, parse_key

    real_blocks = 1 + max((int(p[2].split(".")[1]) for k in metrics
                           if (p := parse_key(k)) and p[2].startswith("blocks.")), default=0)
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        parsed = parse_key(key)
        if parsed is None or not parsed[2].startswith("blocks."):
            out[key] = value
            continue
        stat, tensor, layer = parsed
        _, first, rest = layer.split(".", 2)
        for block in range(int(first), blocks, real_blocks):
            varied = value
            if isinstance(value, float) and math.isfinite(value) and value not in (0.0, 1.0):
                j = 1 + JITTER * (rng.random() - 0.5)
                varied = 1 - (1 - value) * j if stat == "cos_sim" else value * j
            out[layer_key(stat, tensor, f"blocks.{block}.{rest}")] = varied
    return out


def schedule(steps: int, interval: int, resumes: dict[int, int], debug: tuple[int, int]
             ) -> Iterator[tuple[int, bool]]:
    """(step, fp8_stats logs) in the order a run with these resumes logs them."""
    step, done = 0, set()
    while step < steps:
        yield step, step % interval == 0 or debug[0] <= step < debug[1]
        if step in resumes and step not in done:
            done.add(step)
            step = resumes[step]
        else:
            step += 1


def records(args: argparse.Namespace) -> Iterator[tuple[int, dict[str, Any]]]:
    """The scaled run's records: step 0 as the real run's (initial-scale markers), a logging
    step as one of the real run's later logging steps, any other step as a plain one."""
    real = _real_steps(args.real)
    rng = random.Random(0)
    is_fp8 = {s: any(len(m) > 100 for m in ms) for s, ms in real.items()}
    fp8_steps = [s for s in sorted(real) if is_fp8[s] and s > 0]
    plain = next(s for s in sorted(real) if not is_fp8[s] and s > max(fp8_steps[:1] or [0]))
    scaled = {s: [_scaled(m, args.blocks, rng) for m in real[s]] for s in [0, *fp8_steps]}
    for n, (step, fp8) in enumerate(schedule(args.steps, args.interval, dict(args.resume),
                                             args.debug)):
        seq = (scaled[0] if step == 0 else scaled[fp8_steps[n % len(fp8_steps)]] if fp8
               else real[plain])
        for metrics in seq:
            yield step, metrics


def hparams(args: argparse.Namespace) -> dict[str, Any]:
    """The real run's hparams.json with the scaled model's layer order."""
    from foundry_fp8.health.keys import LAYER_ORDER, layer_order_params

    values = json.loads((args.real / "hparams.json").read_text())
    values = {k: v for k, v in values.items() if not k.startswith(LAYER_ORDER)}
    return {**values, **layer_order_params([f"blocks.{b}.{p}" for b in range(args.blocks)
                                            for p in PARTS], 6000)}


def write_jsonl(args: argparse.Namespace, folder: Path) -> Path:
    folder.mkdir(parents=True)
    with (folder / "metrics.jsonl").open("w") as f:
        for step, metrics in records(args):
            f.write(json.dumps({"step": step, "metrics": metrics}) + "\n")
    (folder / "hparams.json").write_text(json.dumps(hparams(args)))
    return folder


def write_wandb(args: argparse.Namespace, folder: Path) -> Path:
    """One offline attempt per resume, `resume: allow`, as Composer's WandBLogger logs."""
    import wandb

    folder.mkdir(parents=True)
    attempts: list[list[tuple[int, dict[str, Any]]]] = [[]]
    last = -1
    for step, metrics in records(args):
        if step < last:
            attempts.append([])
        attempts[-1].append((step, metrics))
        last = step
    config = hparams(args)
    for attempt in attempts:
        run = wandb.init(mode="offline", dir=str(folder), id="scale", resume="allow",
                         project="report-scale", config=config,
                         settings=wandb.Settings(allow_offline_artifacts=False, console="off",
                                                 _disable_stats=True, _disable_meta=True))
        for step, metrics in attempt:
            run.log(metrics, step=step)
        run.finish()
    return folder / "wandb"


def write_mlflow(args: argparse.Namespace, folder: Path) -> Path:
    """With MLflow's FileStore, as Composer's MLFlowLogger with
    `log_duplicated_metric_every_n_steps: 0` logs (every value)."""
    from mlflow.entities import Metric, Param, RunStatus
    from mlflow.store.tracking.file_store import FileStore

    store = FileStore(str(folder / "mlruns"))
    experiment = store.create_experiment("report-scale")
    run_id = store.create_run(experiment, "bench", 0, [], "scale").info.run_id
    params = [Param(k, str(v)[:6000]) for k, v in hparams(args).items()]
    for i in range(0, len(params), 100):
        store.log_batch(run_id, [], params[i:i + 100], [])
    stamp = start = 1_700_000_000_000
    for stamp, (step, metrics) in enumerate(records(args), start):
        points = [Metric(k, float(v), stamp, step) for k, v in metrics.items()
                  if isinstance(v, (int, float))]
        for i in range(0, len(points), 1000):
            store.log_batch(run_id, points[i:i + 1000], [], [])
    store.update_run_info(run_id, RunStatus.FINISHED, stamp, None)
    return folder / "mlruns" / experiment / run_id


WRITERS = {"jsonl": write_jsonl, "wandb": write_wandb, "mlflow": write_mlflow}


#: The report in a fresh interpreter, its own CPU time and peak RSS last on stderr (W&B's
#: service, started by the writer, is another child: RUSAGE_CHILDREN would mix it in).
_CHILD = """
import resource, sys
from foundry_fp8.cli import main
code = main(["report", *sys.argv[1:]])
use = resource.getrusage(resource.RUSAGE_SELF)
print(use.ru_utime + use.ru_stime, use.ru_maxrss, file=sys.stderr)
sys.exit(code)
"""


def measure(given: Path, out: Path) -> dict[str, Any]:
    """One `foundry-fp8 report` in a fresh interpreter: wall and CPU seconds, peak RSS."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, str(given), "--out", str(out)],
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.perf_counter() - start
    *said, last = done.stderr.strip().splitlines() or [""]
    cpu, peak_kib = last.split() if len(last.split()) == 2 else ("nan", "0")
    return {"exit": done.returncode, "wall_s": round(wall, 1), "cpu_s": round(float(cpu), 1),
            "peak_mib": round(int(peak_kib) / 1024),  # Linux: KiB
            "load_average_1min": os.getloadavg()[0],
            "said": said[-1:] if done.returncode else []}


def numbers(out: Path) -> int:
    """Layers x tensors x statistics x logging steps, from the report's first line: the size
    of what was read (a step that logged fewer counts whole)."""
    import re

    head = (out / "fp8_report.md").read_text().splitlines()[2]
    layers, tensors, steps = map(int, re.findall(r"(\d+) (?:layers|tensors|logging steps)", head))
    return layers * tensors * steps * len(head.split("statistics: ")[1].split(", "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", type=Path, default=REPO / "runs" / "mpt-tiny-cpu",
                        help="a real run folder (metrics.jsonl, hparams.json) to scale up")
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--debug", default="20000:21000", help="A:B, steps at interval 1")
    parser.add_argument("--resume", action="append", default=None, help="AT:BACK (repeatable)")
    parser.add_argument("--sinks", nargs="+", choices=sorted(WRITERS), default=["jsonl"])
    parser.add_argument("--work", type=Path, default=None, help="where the runs are written")
    args = parser.parse_args()
    if not (args.real / "metrics.jsonl").is_file():
        parser.error(f"{args.real}: no metrics.jsonl: make a real run first (make run)")
    args.debug = tuple(map(int, args.debug.split(":")))
    args.resume = [tuple(map(int, r.split(":"))) for r in args.resume or ["30000:29000",
                                                                           "40000:39500"]]
    work = Path(tempfile.mkdtemp(prefix="report-scale-") if args.work is None else args.work)
    shape = (f"{args.blocks} blocks, {args.steps} steps at interval {args.interval}, "
             f"{args.debug[1] - args.debug[0]} at interval 1, resumes {args.resume}")
    result: dict[str, Any] = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(), "shape": shape, "sinks": {}}
    for sink in args.sinks:
        given = WRITERS[sink](args, work / sink)
        size = sum(p.stat().st_size for p in (work / sink).rglob("*") if p.is_file())
        figures = measure(given, work / f"report-{sink}")
        figures["input_mb"] = round(size / 1e6)
        if figures["exit"] == 0:
            figures["numbers"] = n = numbers(work / f"report-{sink}")
            figures["us_per_number"] = round(figures["cpu_s"] / n * 1e6, 1)
        figures["meets_target"] = (figures["exit"] == 0
                                   and figures["peak_mib"] < TARGET_PEAK_MIB[sink]
                                   and figures["us_per_number"] < TARGET_US_PER_NUMBER)
        result["sinks"][sink] = figures
        print(sink, json.dumps(figures), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "report_scale_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# `foundry-fp8 report` at scale ({result['when']}, {result['machine']})", "",
             f"Run shape: {shape}.", ""]
    for sink, f in result["sinks"].items():
        lines.append(f"- {sink}: {f['input_mb']} MB, exit {f['exit']}, {f['wall_s']} s wall, "
                     f"{f['cpu_s']} s CPU ({f.get('us_per_number', '-')} us a number of "
                     f"{f.get('numbers', 0):,}), peak {f['peak_mib']} MiB (target < "
                     f"{TARGET_PEAK_MIB[sink]} MiB, < {TARGET_US_PER_NUMBER} us a number: "
                     f"{'met' if f['meets_target'] else 'NOT met'}), load "
                     f"{f['load_average_1min']:.2f}")
    (RESULTS / "report_scale_cpu.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
