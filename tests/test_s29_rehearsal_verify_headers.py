"""`benchmarks/gpu/verify.sh`'s NVRTC header fallback, with stand-in `python3` and `nvidia-smi`:
the toolkit's headers are kept for the tests only where the FP8 step works with them. Before,
a step failing for any other cause (seen in the CPU rehearsal: no CUDA device) exported them
anyway, so every GPU test ran with headers nothing chose and the record named them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

#: Stand-in python3: the FP8 step (the only call naming te.Linear) works only with the headers
#: when $HEADERS_FIX is 1; pytest writes the NVTE_CUDA_INCLUDE_DIR it was given; all else is OK.
PYTHON3 = """#!/bin/bash
case "$*" in
  *te.Linear*) [ "$HEADERS_FIX" = 1 ] && [ -n "$NVTE_CUDA_INCLUDE_DIR" ] ;;
  *"-m pytest"*) echo "pytest saw NVTE_CUDA_INCLUDE_DIR=${NVTE_CUDA_INCLUDE_DIR:-unset}" ;;
esac
"""


@pytest.mark.parametrize(("headers_fix", "expected"), [("1", "{headers}"), ("0", "unset")])
def test_the_toolkit_headers_stay_only_where_the_fp8_step_works_with_them(tmp_path, headers_fix,
                                                                        expected):
    stubs, cuda, out = tmp_path / "bin", tmp_path / "cuda", tmp_path / "out"
    stubs.mkdir()
    (cuda / "include").mkdir(parents=True)
    for name, body in (("python3", PYTHON3), ("nvidia-smi", "#!/bin/bash\n")):
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "NVTE_CUDA_INCLUDE_DIR"}
    env.update(PATH=f"{stubs}:{os.environ['PATH']}", CUDA_HOME=str(cuda), OUT=str(out),
               HEADERS_FIX=headers_fix)
    done = subprocess.run(["bash", str(REPO_ROOT / "benchmarks/gpu/verify.sh"), "tests"],
                          env=env, capture_output=True, text=True, timeout=60)
    headers = str(cuda / "include")
    want = expected.format(headers=headers)
    assert f"pytest saw NVTE_CUDA_INCLUDE_DIR={want}" in done.stdout, done.stdout + done.stderr
    environment = (out / "environment-tests.txt").read_text()
    shown = headers if headers_fix == "1" else "unset, TE picks its own"
    assert f"NVTE_CUDA_INCLUDE_DIR={shown}\n" in environment, environment
    assert ("(with NVTE_CUDA_INCLUDE_DIR=" in environment) is (headers_fix == "1")
