"""Wall-clock time of `foundry-fp8 lint` on one YAML, in a fresh interpreter each time (what a
user or a pre-commit hook waits for: Python's start, our imports, reading and linting), and
whether torch got imported. Target: under 1 s per file, torch never imported. Also the time of
`lint_file` alone, in one process, for the seed config and each config of tests/lint_corpus.

Also the time of `lint_file` on a generated hostile input, one flow mapping of 60,000 keys
(some 900 KB, under the size bound), with omegaconf's own node limit on and lifted: before
session 16 this took 30 s to 3 min (a DictConfig of 120,000 nodes, 60,000 did-you-means, a copy
of the positions per finding); the linter now refuses it at the value past its bound.

A timed test would fail on a loaded machine; this records the load average next to each figure.

    .venv/bin/python benchmarks/lint_speed.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout, not an installed copy
SEED = REPO / "foundry_fp8" / "tools" / "yamls" / "mpt-1b-fp8.yaml"
CORPUS = REPO / "tests" / "lint_corpus"
RESULTS = REPO / "benchmarks" / "results"
TARGET_S = 1.0

_CHILD = """
import sys, time
start = time.perf_counter()
from foundry_fp8.cli import main
code = main(["lint", "--format", "json", sys.argv[1]])
print(time.perf_counter() - start, "torch" in sys.modules, file=sys.stderr)
"""


def cli_round(path: Path) -> tuple[float, float, bool]:
    """(wall seconds of the whole process, seconds from first import to exit, torch imported)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    wall = time.perf_counter() - start
    inner, torch = done.stderr.strip().splitlines()[-1].split()
    return wall, float(inner), torch == "True"


def bare_python_round() -> float:
    """Wall seconds of `python -c pass`: the interpreter's own start, the floor under cli_round."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - start


def in_process(paths: list[Path], rounds: int) -> dict[str, float]:
    """Median seconds of `lint_file` per path, imports already paid."""
    from foundry_fp8.environment import gather_snapshot
    from foundry_fp8.lint.cli import lint_file

    snapshot = gather_snapshot(probe_te_import=False, probe_gpu=False)
    out = {}
    for path in paths:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            lint_file(path, 1, snapshot)
            times.append(time.perf_counter() - start)
        out[str(path.relative_to(REPO))] = statistics.median(times)
    return out


def large_input(rounds: int) -> dict[str, float]:
    """Median seconds of `lint_file` on a flow mapping of 60,000 keys, with omegaconf's node
    limit as installed and lifted (OMEGACONF_MAX_YAML_EXPANDED_NODES=none)."""
    import tempfile

    from foundry_fp8.lint.cli import lint_file

    out = {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "flow-60000.yaml"
        path.write_text("{" + ", ".join(f"key_{i:05d}: {i}" for i in range(60_000)) + "}\n")
        for name, limit in (("omegaconf_limit_on", None), ("omegaconf_limit_none", "none")):
            saved = os.environ.pop("OMEGACONF_MAX_YAML_EXPANDED_NODES", None)
            if limit is not None:
                os.environ["OMEGACONF_MAX_YAML_EXPANDED_NODES"] = limit
            try:
                times = []
                for _ in range(rounds):
                    start = time.perf_counter()
                    lint_file(path)
                    times.append(time.perf_counter() - start)
            finally:
                os.environ.pop("OMEGACONF_MAX_YAML_EXPANDED_NODES", None)
                if saved is not None:
                    os.environ["OMEGACONF_MAX_YAML_EXPANDED_NODES"] = saved
            out[name] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    rounds, bare = [], []
    for _ in range(args.rounds):  # interleaved, so both see the same load
        rounds.append(cli_round(SEED))
        bare.append(bare_python_round())
    walls, inners, torch = [r[0] for r in rounds], [r[1] for r in rounds], [r[2] for r in rounds]
    corpus = sorted(p for p in CORPUS.rglob("*") if p.is_file() and p.name != "expected.yaml"
                    and p.suffix in (".yaml", ".yml", ".json")) if CORPUS.is_dir() else []
    result = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "load_average_1min": os.getloadavg()[0],
        "file": str(SEED.relative_to(REPO)),
        "rounds": args.rounds,
        "cli_wall_s": {"median": statistics.median(walls), "min": min(walls), "max": max(walls)},
        "cli_after_start_s": {"median": statistics.median(inners), "min": min(inners),
                              "max": max(inners)},
        "bare_python_s": {"median": statistics.median(bare), "min": min(bare),
                          "max": max(bare)},
        "torch_imported": any(torch),
        "lint_file_s": in_process([SEED, *corpus], rounds=5),
        "flow_mapping_60000_keys_s": large_input(rounds=3),
        "target_s": TARGET_S,
        "meets_target": statistics.median(walls) < TARGET_S and not any(torch),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lint_speed_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    slowest = max(result["lint_file_s"].items(), key=lambda kv: kv[1])
    (RESULTS / "lint_speed_cpu.md").write_text(
        f"# `foundry-fp8 lint` speed ({result['when']}, {result['machine']}, load "
        f"{result['load_average_1min']:.2f})\n\n"
        f"- `foundry-fp8 lint {result['file']}` in a fresh interpreter, {args.rounds} rounds: "
        f"median {result['cli_wall_s']['median']:.3f} s (min {result['cli_wall_s']['min']:.3f}, "
        f"max {result['cli_wall_s']['max']:.3f}); from the first import to exit "
        f"{result['cli_after_start_s']['median']:.3f} s. torch imported: "
        f"{result['torch_imported']}. `python -c pass` alone, interleaved: median "
        f"{result['bare_python_s']['median']:.3f} s. Target < {TARGET_S} s: "
        f"{'met' if result['meets_target'] else 'NOT met'}.\n"
        f"- `lint_file` alone (imports paid), median of 5: seed "
        f"{result['lint_file_s'][result['file']] * 1000:.1f} ms; slowest of "
        f"{len(result['lint_file_s'])} files {slowest[0]} {slowest[1] * 1000:.1f} ms.\n"
        f"- `lint_file` on one flow mapping of 60,000 keys, median of 3: "
        + ", ".join(f"{name} {seconds:.2f} s"
                    for name, seconds in result["flow_mapping_60000_keys_s"].items()) + ".\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
