"""Here, after a device call of `verify.sh tests`: turn what came back (environment-tests.txt,
gpu-tests.xml) into `benchmarks/results/gpu_tests_<gpu>.{json,md}` with the GPU, driver, CUDA
and package versions, the date, the command and every test's outcome and time.

    python benchmarks/gpu/record.py DIR --command "bash benchmarks/gpu/verify.sh tests ..."
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results"
# A lease whose nvidia-smi printed nothing still ran the tests: keep them, and say why no GPU is named.
NO_GPU = "a GPU nvidia-smi did not name"


def environment(text: str) -> dict[str, Any]:
    """GPU name, driver, memory and the doctor's version lines from environment-tests.txt."""
    gpu = re.search(r"^(NVIDIA [^,\n]+), ([\d.]+), (\d+ MiB), (\d+ MHz)$", text, re.M)
    cuda = re.search(r"CUDA Version: ([\d.]+)", text)
    found = {"gpu": gpu.group(1) if gpu else None, "driver": gpu.group(2) if gpu else None,
             "memory": gpu.group(3) if gpu else None, "max_sm_clock": gpu.group(4) if gpu else None,
             "driver_cuda": cuda.group(1) if cuda else None,
             "date": text.splitlines()[0].strip() if text else None,
             "te_alone": "TE alone: OK" in text, "te_after_torch": "TE after torch: OK" in text,
             "fp8_linear_step": "FP8 te.Linear step: OK" in text}
    include = re.search(r"^NVTE_CUDA_INCLUDE_DIR=(.*)$", text, re.M)
    found["nvte_cuda_include_dir"] = include.group(1) if include else None
    return found


def tests(xml_path: Path) -> list[dict[str, Any]]:
    """Every test case of a pytest junit XML: name, outcome, seconds, first message line."""
    rows = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                text = (child.get("message") or child.text or "").strip()  # may be blank
                message = text.splitlines()[0][:300] if text else ""
        rows.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                     "seconds": float(case.get("time") or 0), "message": message})
    return rows


def versions(log: str) -> dict[str, str]:
    """The versions install.sh printed (`torch X TE Y composer Z llmfoundry W foundry_fp8 V`)."""
    match = re.search(r"^torch (\S+) TE (\S+) composer (\S+) llmfoundry (\S+) foundry_fp8 (\S+)$",
                      log, re.M)
    keys = ("torch", "transformer_engine", "composer", "llmfoundry", "foundry_fp8")
    return dict(zip(keys, match.groups(), strict=True)) if match else {}


def free_stem(stem: str) -> str:
    """`stem`, or `stem_run<N>` with the first N whose files are not in RESULTS yet: a later
    lease on the same GPU must not replace an earlier lease's record."""
    taken = {path.stem for path in RESULTS.iterdir()}
    names = itertools.chain([stem], (f"{stem}_run{n}" for n in itertools.count(2)))
    return next(name for name in names if name not in taken)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="the files that came back from the device call")
    parser.add_argument("--command", required=True, help="the device command, as run")
    parser.add_argument("--install-log", type=Path, help="install.sh's output (the versions)")
    args = parser.parse_args()
    env = environment((args.dir / "environment-tests.txt").read_text())
    rows = tests(args.dir / "gpu-tests.xml")
    ver = versions(args.install_log.read_text()) if args.install_log else {}
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error",
                                                                 "skipped")}
    result = {"environment": env, "versions": ver, "command": args.command, "counts": counts,
              "tests": rows}
    gpu = env["gpu"] or NO_GPU
    if not env["gpu"]:
        print(f"warning: {args.dir / 'environment-tests.txt'} has no nvidia-smi GPU line; "
              f"recorded as '{NO_GPU}'", file=sys.stderr)
    RESULTS.mkdir(exist_ok=True)
    stem = free_stem("gpu_tests_" + re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_"))
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# `pytest -m gpu` on {gpu} ({env['date']})", "",
             f"Driver {env['driver']} (CUDA {env['driver_cuda']}), {env['memory']}; "
             + ", ".join(f"{k} {v}" for k, v in ver.items()) + ".", "",
             f"Command (device call): `{args.command}`", "",
             f"TE import alone: {'OK' if env['te_alone'] else 'FAILED'}; after torch: "
             f"{'OK' if env['te_after_torch'] else 'FAILED'}; one FP8 te.Linear step: "
             f"{'OK' if env['fp8_linear_step'] else 'FAILED'}; NVTE_CUDA_INCLUDE_DIR: "
             f"{env['nvte_cuda_include_dir']}.", "",
             ", ".join(f"{v} {k}" for k, v in counts.items()) + ".", "",
             "| test | outcome | s | message |", "|---|---|---:|---|"]
    lines += [f"| `{r['test']}` | {r['outcome']} | {r['seconds']:.1f} | "
              f"{r['message'].replace('|', '/')} |" for r in rows]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / stem}.json and .md: {counts}")


if __name__ == "__main__":
    main()
