#!/usr/bin/env bash
# On the GPU machine, after every gpu-parts/pK was carried there: rebuild the kit, install it and
# foundry-fp8 (with its entry points, which LLM-Foundry's registries need) into .gpu-site/.
# Idempotent: a second call only reinstalls foundry-fp8. Then: export PYTHONPATH=$PWD/.gpu-site
set -euo pipefail
cd "$(dirname "$0")/../.."
site=$PWD/.gpu-site
if [ ! -e "$site/.kit-installed" ]; then
  join=$(ls gpu-parts/p*/join-and-install.sh | head -1)
  MAX_JOBS=${MAX_JOBS:-$(nproc)} bash "$join" gpu-parts "$site"
  touch "$site/.kit-installed"
fi
export PYTHONPATH=$site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
  --target "$site" .
python3 -c "import transformer_engine.pytorch as te, composer, llmfoundry, foundry_fp8; \
print('TE', te.__version__ if hasattr(te, '__version__') else '?', 'composer', composer.__version__, \
'llmfoundry', llmfoundry.__version__, 'foundry_fp8', foundry_fp8.__version__)"
