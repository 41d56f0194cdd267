"""MPT-1B FP8 vs BF16 training throughput on one GPU: `foundry-fp8 bench` run on this checkout's
foundry_fp8, writing to this repository's benchmarks/results/ unless --out says otherwise.

    python benchmarks/mpt_throughput.py                       # all variants, results/mpt-1b-<gpu>.*
    python benchmarks/mpt_throughput.py --variants bf16,fp8-te-swap --seq-len 2048 --steps 30
    python benchmarks/mpt_throughput.py --tiny --out /tmp/bench   # CPU code path, for CI

Run through the CLI's `main`, so a closed, full or early-closed output and Ctrl-C end it as they
end `foundry-fp8 bench` (one line and an exit status, no traceback).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from foundry_fp8.cli import main  # noqa: E402  (this checkout's package)


def argv_for(args: list[str]) -> list[str]:
    """`foundry-fp8 bench` with these options, --out this repository's results unless given:
    ours goes first, so argparse's last-one-wins lets any --out of the user's (abbreviated, or
    `.`, the CLI's own default) replace it."""
    return ["bench", "--out", str(ROOT / "benchmarks" / "results"), *args]

if __name__ == "__main__":
    sys.exit(main(argv_for(sys.argv[1:])))
