#!/usr/bin/env bash
# On the GPU machine after install.sh: the GPU tests, the doctor and the MPT-1B benchmark, with
# every log and result under $OUT (what comes back from a device call).
#   bash benchmarks/gpu/verify.sh tests [PYTEST_ARGS...]   pytest -m gpu (default: all of tests/)
#   bash benchmarks/gpu/verify.sh bench [BENCH_ARGS...]    foundry-fp8 bench (default: every variant)
# Each part fits one 10-min call; a bench that does not is split with --variants over two calls.
# No -e: a failing step must not keep the later ones (and their logs) from running.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONPATH=$PWD/.gpu-site PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
out=${OUT:-/tmp/foundry-fp8-out}
mkdir -p "$out"
what=${1:?usage: verify.sh tests|bench [ARGS...]}
shift
# One FP8 te.Linear step, forward and backward: TE compiles some kernels at run time (NVRTC) with
# the headers of NVTE_CUDA_INCLUDE_DIR, which TE sets to pip's nvidia/cu13 when unset. If that
# step fails and the machine's toolkit headers ($CUDA_HOME/include) exist, they are tried, and
# kept only if the step then works (else a failure for another cause would run every test with
# headers nothing chose, and the record would name them).
probe='import torch, transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
layer = te.Linear(256, 256, device="cuda")
x = torch.randn(64, 256, device="cuda", requires_grad=True)
with te.autocast(enabled=True, recipe=DelayedScaling()):
    y = layer(x)
y.sum().backward(); torch.cuda.synchronize(); print("FP8 te.Linear step: OK")'
{
  date -u +%FT%TZ
  nvidia-smi
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  # On CPU with these packages TE imported only after torch (libnccl.so.2); the doctor imports it
  # alone in a fresh interpreter, so an FP8206 there with torch-first OK is that, not a broken TE.
  python3 -c "import transformer_engine.pytorch" && echo "TE alone: OK"
  python3 -c "import torch, transformer_engine.pytorch" && echo "TE after torch: OK"
  headers=${CUDA_HOME:-/usr/local/cuda}/include
  if ! python3 -c "$probe" && [ -z "${NVTE_CUDA_INCLUDE_DIR:-}" ] && [ -d "$headers" ] &&
      NVTE_CUDA_INCLUDE_DIR=$headers python3 -c "$probe"; then
    export NVTE_CUDA_INCLUDE_DIR=$headers
    echo "(with NVTE_CUDA_INCLUDE_DIR=$NVTE_CUDA_INCLUDE_DIR)"
  fi
  echo "NVTE_CUDA_INCLUDE_DIR=${NVTE_CUDA_INCLUDE_DIR:-unset, TE picks its own}"
  # What the tests, the bench and TE's import take from the device (the kit does not carry them,
  # or carries a fallback install.sh used only where the device had none): one missing shows
  # here by name instead of as an error deep in a test.
  python3 -c 'import importlib, importlib.metadata as md
for dist, mod in [("pytest", "pytest"), ("hypothesis", "hypothesis"), ("numpy", "numpy"),
                  ("matplotlib", "matplotlib"),
                  ("pillow", "PIL"), ("tqdm", "tqdm"), ("regex", "regex"), ("filelock", "filelock"),
                  ("safetensors", "safetensors"), ("pyyaml", "yaml"), ("packaging", "packaging"),
                  ("onnx", "onnx"), ("onnxscript", "onnxscript"), ("onnx_ir", "onnx_ir"),
                  ("einops", "einops"), ("ml_dtypes", "ml_dtypes"), ("protobuf", "google.protobuf")]:
    try:
        module = importlib.import_module(mod)
    except Exception as err:
        print(f"device package {dist} MISSING ({type(err).__name__}: {err})")
        continue
    kit = " (the kit fallback)" if ".gpu-site/" in (module.__file__ or "") else ""
    print(f"device package {dist} {md.version(dist)}{kit}")'
  python3 -m foundry_fp8.cli doctor
} > "$out/environment-$what.txt" 2>&1  # a { } group: its export holds below
cat "$out/environment-$what.txt"
case $what in
  tests)
    timeout=()
    python3 -c "import pytest_timeout" 2>/dev/null && timeout=(--timeout=300)
    # The whole tests/ is collected: a CPU-only test module that cannot import here (a package
    # neither the kit nor the device has) is reported, not allowed to stop the GPU tests.
    python3 -m pytest -m gpu -p no:cacheprovider -v -rfEs --durations=0 "${timeout[@]}" \
      --continue-on-collection-errors \
      --junitxml="$out/gpu-tests.xml" "${@:-tests}" 2>&1 | tee "$out/gpu-tests.log"
    ;;
  bench)
    python3 -m foundry_fp8.cli bench --out "$out" "$@" 2>&1 | tee "$out/bench.log"
    ;;
  *) echo "verify.sh: tests or bench, not $what" >&2; exit 2 ;;
esac
