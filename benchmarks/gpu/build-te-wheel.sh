#!/usr/bin/env bash
# Build TransformerEngine's torch extension (sdist transformer_engine_torch-2.20.2) into a wheel for
# the lent GPU machine (Python 3.12, torch 2.11.0+cu130), so that machine need not compile it.
#   bash benchmarks/gpu/build-te-wheel.sh OUTDIR [DIR]   (DIR holds the sdist and TE's core wheels;
#                                                         default .gpu-wheels)
# Here (prepare.sh): builds in its own venv under /tmp with torch 2.11.0 from PyPI, then loads the
# extension there; compiling takes 8-10 min on 2 idle cores (MAX_JOBS=2).
# On the GPU machine (install.sh's fallback, no network): BUILD_PYTHON=python3 builds with that
# interpreter's own torch and pip CUDA packages, installing nothing.
# Idempotent: does nothing when OUTDIR already holds the wheel.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p "$1"
out=$(cd "$1" && pwd) dir=$(cd "${2:-.gpu-wheels}" && pwd)
ver=2.20.2
if ls "$out"/transformer_engine_torch-$ver-cp312-*.whl >/dev/null 2>&1; then exit 0; fi
py=${BUILD_PYTHON:-}
if [ -z "$py" ]; then
  venv=${TE_BUILD_VENV:-/tmp/foundry-fp8-te-build-venv}
  # The device's interpreter is 3.12: the extension's tag (cp312) must match it. (A pyenv shim
  # named python3.12 may exist yet refuse to run, hence the candidates.)
  if [ ! -x "$venv/bin/python" ]; then
    for p312 in ${PYTHON312:-} python3.12 ~/.pyenv/versions/3.12*/bin/python3.12; do
      "$p312" -c '' 2>/dev/null && break
    done
    "$p312" -m venv "$venv"
  fi
  py=$venv/bin/python
  # PyPI's torch 2.11.0 is the device's 2.11.0+cu130 (same sha256); its deps are the exact cuDNN,
  # NCCL and cuBLAS pip packages whose headers we compile against and the device runs. No build
  # isolation below, so the build tools go into the venv too (numpy only quiets torch's warning).
  "$py" -m pip install -q torch==2.11.0 wheel setuptools pybind11 ninja packaging numpy
fi
"$py" -c "import torch; assert torch.__version__ == '2.11.0+cu130' and torch._C._GLIBCXX_USE_CXX11_ABI"
nvidia=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/nvidia
# NVTE_PYTORCH_FORCE_BUILD: else setup.py first tries to download a prebuilt wheel from GitHub.
# NVTE_NO_LOCAL_VERSION: else a git hash is appended to the version when built inside a git
#   checkout, and TE's import asserts that the extension's version equals the core's.
# CUDA_HOME: TE's own nvcc lookup takes a wrapper script on PATH (here /usr/local/bin/nvcc) as the
#   toolkit root; `nvcc -V` gives the CUDA version, hence the arch list, hence NCCL EP on.
# CPATH: TE adds only $CUDA_HOME/include, which lacks cudnn.h and nccl.h (and, here, cublas/nvrtc);
#   CPATH dirs come after -I, so toolkit headers win and the pip ones fill the gaps.
#   (NVTE_BUILD_USE_NVIDIA_WHEELS=1 instead fails: pip's cu13 headers lack crt/host_config.h.)
export NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_NO_LOCAL_VERSION=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
[ -e "$CUDA_HOME/include/crt/host_config.h" ] ||
  { echo "no CUDA toolkit at CUDA_HOME=$CUDA_HOME" >&2; exit 1; }
CPATH=$(ls -d "$nvidia"/*/include | paste -sd:)
export CPATH
start=$(date +%s)
"$py" -m pip wheel -q --no-index --no-deps --no-build-isolation --no-cache-dir -w "$out" \
  "$dir"/transformer_engine_torch-$ver.tar.gz
whl=$(ls "$out"/transformer_engine_torch-$ver-cp312-*.whl)
echo "built $whl in $(( $(date +%s) - start )) s"
trap 'rm -f "$whl"; echo "build-te-wheel: check failed, wheel removed" >&2' ERR  # no bad wheel left
# Must be the C++11 ABI of torch 2.11 (std::__cxx11 symbols, none of the old ABI's std::string).
so=$(mktemp -d)
"$py" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$whl" "$so"
so=$(ls "$so"/transformer_engine/wheel_lib/transformer_engine_torch.*.so)
if command -v nm >/dev/null; then
  syms=$(nm -D "$so")
  grep -q _ZNSt7__cxx11 <<<"$syms" && ! grep -q _ZNSs <<<"$syms" ||
    { echo "wrong C++ ABI: $so" >&2; false; }
fi
[ -z "${BUILD_PYTHON:-}" ] || exit 0  # on the device, install.sh's own import check follows
# Load it as TE does (every symbol resolved, TE's version checks, the cuDNN check); no GPU needed.
"$py" -m pip install -q --no-deps --force-reinstall "$whl" \
  "$dir"/transformer_engine_cu13-$ver-*.whl "$dir"/transformer_engine-$ver-*.whl
"$py" -c "import torch, transformer_engine.common as c; c.load_framework_extension('torch')"
echo "loaded: OK"
