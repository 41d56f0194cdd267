#!/usr/bin/env bash
# One device call per step of a 15-minute lease (README: "A 15-minute lease"), after the six
# carries of gpu-parts/pK, back to back (the machine goes back after ~30 s idle, and a fresh one
# has neither the parts nor the kit). Each step runs install.sh first: the first call installs
# the kit (~30 s), later ones only reinstall foundry-fp8 (a few seconds); what it writes goes to
# $OUT, what it prints is the short part to read at once.
#   bash benchmarks/gpu/lease.sh check    the GPU tests, emulate_vs_te.py, stats_gpu_cost.py (~4 min)
#   bash benchmarks/gpu/lease.sh memory   stats_memory.py, a process per case (~3 min; CASES=, CARRY_OVER=1)
#   bash benchmarks/gpu/lease.sh bench    the variants the issue's goals need (~5 min; VARIANTS=)
# No -e: a failing step must not keep the later ones (and their logs) from running.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=${OUT:-/tmp/foundry-fp8-out}
mkdir -p "$out"
step=${1:?usage: lease.sh check|memory|bench}
case $step in check|memory|bench) ;; *) echo "lease.sh: check, memory or bench, not $step" >&2; exit 2 ;; esac
start=$SECONDS
bash benchmarks/gpu/install.sh > "$out/install-$step.log" 2>&1 || {
  tail -20 "$out/install-$step.log"
  echo "lease.sh: install.sh failed (a fresh machine: carry gpu-parts/p1..p6 again)"; exit 1; }
tail -1 "$out/install-$step.log"
export PYTHONPATH=$PWD/.gpu-site PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
case $step in
  check)
    # its output is environment-tests.txt and gpu-tests.log, both in $out: no copy (a device
    # call returns 8 files, and this step's scripts write 7 on the GPU)
    bash benchmarks/gpu/verify.sh tests 2>&1 | tail -25
    timeout 120 python3 benchmarks/gpu/emulate_vs_te.py --out "$out" 2>&1 | tail -5
    timeout 120 python3 benchmarks/stats_gpu_cost.py --out "$out" 2>&1 | tail -5
    ;;
  memory)
    # each case in its own process (~1 min each); the bench step's 'at start GB' shows the
    # carry-over between variants, --carry-over (three more processes) when time is left
    timeout 400 python3 benchmarks/gpu/stats_memory.py --out "$out" \
      --cases "${CASES:-none,gradient,all}" ${CARRY_OVER:+--carry-over} 2>&1 | tail -30
    ;;
  bench)
    # bf16 (the ratio's base and the MFU goal), the best FP8 variant so far, and the cost of
    # fp8_stats at interval 100 against it: the issue's three goals; 'at start GB' in the
    # result shows what each variant inherits from the ones before it
    bash benchmarks/gpu/verify.sh bench \
      --variants "${VARIANTS:-bf16,fp8-te-swap-fused,fp8-te-swap-stats100}" 2>&1 | tail -30
    ;;
esac
echo "lease.sh $step: $((SECONDS - start)) s"
