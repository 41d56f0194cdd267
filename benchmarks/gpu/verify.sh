#!/usr/bin/env bash
# On the GPU machine after install.sh: the GPU tests, the doctor and the MPT-1B benchmark, with
# every log and result under $OUT (what comes back from a device call).
#   bash benchmarks/gpu/verify.sh [tests|bench|all]   (default all; each part fits one 10-min call)
# No -e: a failing step must not keep the later ones (and their logs) from running.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/.gpu-site PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
out=${OUT:-/tmp/foundry-fp8-out}
mkdir -p "$out"
what=${1:-all}
{
  nvidia-smi
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  # On CPU with these packages TE imported only after torch (libnccl.so.2); the doctor imports it
  # alone in a fresh interpreter, so an FP8206 there with torch-first OK is that, not a broken TE.
  python3 -c "import transformer_engine.pytorch" && echo "TE alone: OK"
  python3 -c "import torch, transformer_engine.pytorch" && echo "TE after torch: OK"
  python3 -m foundry_fp8.cli doctor
} 2>&1 | tee "$out/environment.txt"
if [ "$what" != bench ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests 2>&1 | tee "$out/gpu-tests.log"
fi
if [ "$what" != tests ]; then
  python3 -m foundry_fp8.cli bench --out "$out" 2>&1 | tee "$out/bench.log"
fi
