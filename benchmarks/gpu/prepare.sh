#!/usr/bin/env bash
# Here (networked, GPU-less, with a CUDA 13 toolkit): make the offline kit for the lent GPU machine
# and cut it into part folders that each fit one 64 MiB device call next to the checkout.
#   bash benchmarks/gpu/prepare.sh [KIT_DIR]     (KIT_DIR defaults to ../shared/offline-wheels)
# Result: gpu-parts/p1 ... pN (git-ignored); join-and-install.sh rides in the last one.
# Idempotent: .gpu-wheels (the shared list) and .gpu-wheels-extra (ours) are reused when present.
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=${1:-../shared/offline-wheels}
[ -d .gpu-wheels ] || bash "$kit/fetch.sh" .gpu-wheels
extra=.gpu-wheels-extra
mkdir -p "$extra"
# The list's two sdists become wheels here, so the GPU machine builds nothing: TE's torch extension
# (~10 min on 2 cores here; on failure the sdist travels and install.sh compiles it there) and
# antlr4 (pure Python).
bash benchmarks/gpu/build-te-wheel.sh "$extra" .gpu-wheels ||
  echo "prepare: TE torch wheel NOT built; the sdist travels and install.sh compiles it on the GPU" >&2
ls "$extra"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 ||
  python3 -m pip wheel -q --no-deps -w "$extra" .gpu-wheels/antlr4-python3-runtime-4.9.3.tar.gz
# Pure-Python packages TE 2.20.2's import takes from the device (onnxscript, onnx_ir:
# pytorch/onnx_extensions.py:26-28 through pytorch/export.py:61; einops: attention/inference.py:9),
# at the H200 image's versions: they travel as NAME.whl.fallback, which join-and-install.sh leaves
# alone, and install.sh installs one only where the device lacks it. (onnx itself, a 17 MB binary
# wheel, would take a seventh part.)
fallback=$extra/fallback
if ! ls "$fallback"/*.whl.fallback >/dev/null 2>&1; then
  mkdir -p "$fallback"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 -d "$fallback" \
    onnxscript==0.7.2 onnx_ir==1.0.0 einops==0.8.2
  for wheel in "$fallback"/*.whl; do mv "$wheel" "$wheel.fallback"; done
fi
files=(.gpu-wheels/*.whl "$extra"/*.whl "$fallback"/*.whl.fallback)
ls "$extra"/transformer_engine_torch-*.whl >/dev/null 2>&1 ||
  files+=(.gpu-wheels/transformer_engine_torch-*.tar.gz)
rm -rf gpu-parts
bash "$kit/split.sh" gpu-parts 56 "${files[@]}"
last=$(ls -d gpu-parts/p* | sort -V | tail -1)
cp "$kit/join-and-install.sh" "$last/"
ls -d gpu-parts/p* | sort -V | while read -r part; do echo "$part $(du -sm "$part" | cut -f1) MiB"; done
