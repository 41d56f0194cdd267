"""MPT-1B FP8 vs BF16 training throughput on one GPU: `foundry-fp8 bench` run on this checkout's
foundry_fp8, writing to this repository's benchmarks/results/ unless --out says otherwise.

    python benchmarks/mpt_throughput.py                       # all variants, results/mpt-1b-<gpu>.*
    python benchmarks/mpt_throughput.py --variants bf16,fp8-te-swap --seq-len 2048 --steps 30
    python benchmarks/mpt_throughput.py --tiny --out /tmp/bench   # CPU code path, for CI
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from foundry_fp8.tools import bench  # noqa: E402  (this checkout's package, found through sys.path)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.set_defaults(out=ROOT / "benchmarks" / "results")
    sys.exit(bench.run(parser.parse_args()))
