#!/usr/bin/env bash
# On the GPU machine after install.sh: the GPU tests, the doctor and the MPT-1B benchmark, with
# every log and result under $OUT (what comes back from a device call).
#   bash benchmarks/gpu/verify.sh [tests|bench|all]   (default all; each part fits one 10-min call)
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/.gpu-site PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
out=${OUT:-/tmp/foundry-fp8-out}
mkdir -p "$out"
what=${1:-all}
{ nvidia-smi; python3 -m foundry_fp8.cli doctor; } 2>&1 | tee "$out/environment.txt"
if [ "$what" != bench ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests 2>&1 | tee "$out/gpu-tests.log"
fi
if [ "$what" != tests ]; then
  python3 -m foundry_fp8.cli bench --out "$out" 2>&1 | tee "$out/bench.log"
fi
