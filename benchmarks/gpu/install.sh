#!/usr/bin/env bash
# On the GPU machine, after every gpu-parts/pK was carried there: rebuild the kit, install it and
# foundry-fp8 (with its entry points, which LLM-Foundry's registries need) into .gpu-site/.
# No compiling: prepare.sh put a prebuilt TE torch wheel among the parts. Idempotent: a second call
# only reinstalls foundry-fp8. Then: export PYTHONPATH=$PWD/.gpu-site
set -euo pipefail
cd "$(dirname "$0")/../.."
site=$PWD/.gpu-site
if [ ! -e "$site/.kit-installed" ]; then
  sdist=$(ls gpu-parts/p*/transformer_engine_torch-*.tar.gz 2>/dev/null || true)
  if [ -n "$sdist" ] && ! ls gpu-parts/p*/transformer_engine_torch-*.whl >/dev/null 2>&1; then
    # Fallback (no prebuilt wheel): compile here (16 cores: minutes) with the include fix, as a
    # wheel in a part folder of its own. The sdist must leave the parts: join-and-install.sh would
    # build it again and install it in a second pip call, which skips the transformer_engine/
    # folder already there (pip --target without --upgrade), dropping the extension's .so.
    BUILD_PYTHON=python3 bash benchmarks/gpu/build-te-wheel.sh gpu-parts/p-te "$(dirname "$sdist")"
    mkdir -p .gpu-sdist && mv "$sdist" .gpu-sdist/
  fi
  join=$(ls gpu-parts/p*/join-and-install.sh | head -1)
  bash "$join" gpu-parts "$site"
  # TE's pure-Python imports the device provides (prepare.sh): the kit's copy only where the
  # device has none, so that the device's own version, whatever it is, stays the one used
  for fallback in gpu-parts/p*/*.whl.fallback; do
    [ -e "$fallback" ] || continue
    wheel=$(basename "$fallback" .fallback)
    module=${wheel%%-*}
    python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('$module') is None)" &&
      continue
    tmp=$(mktemp -d)
    cp "$fallback" "$tmp/$wheel"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
      "$tmp/$wheel"
    echo "kit fallback installed: $wheel (the device has no $module)"
  done
  touch "$site/.kit-installed"
fi
export PYTHONPATH=$site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
  --target "$site" .
# torch first: libtransformer_engine.so needs libnccl.so.2, which nothing but torch's own load puts
# within reach (seen on CPU with the same packages: "libnccl.so.2: cannot open shared object file").
python3 -c "import torch, transformer_engine.pytorch as te, composer, llmfoundry, foundry_fp8
from importlib.metadata import version
from llmfoundry.registry import callbacks, algorithms
assert callbacks.get('fp8_stats') and algorithms.get('te_swap')
print('torch', torch.__version__, 'TE', version('transformer_engine_torch'), 'composer',
      composer.__version__, 'llmfoundry', llmfoundry.__version__, 'foundry_fp8', foundry_fp8.__version__)"
