#!/bin/bash
# On the GPU machine, first (scripts/offline_gpu/prepare.sh staged .whl/ and .gguf1/): the environment, the
# missing packages into $W/site, the model's first part into $W/stash, the optimizers check.
# Usage: bash .whl/part1.sh [seconds for the optimizers check, default 200]
W=${WORK:-/tmp}  # where the packages, the model and the checks' folders go
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
nproc; python3 -c "import sys,torch,transformers,triton;print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'tf', transformers.__version__, 'triton', triton.__version__, torch.cuda.is_available(), torch.cuda.is_bf16_supported())"
mkdir -p $W/stash && cp .gguf1/a $W/stash/a && echo "stash ok $(stat -c %s $W/stash/a)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $W/site .whl/*.whl 2>&1 | tail -3
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target $W/site .whl/pycosat-0.6.6.tar.gz > $W/pycosat.log 2>&1 && echo "pycosat built" || { mkdir -p $W/site/pycosat && printf 'def solve(*a, **k):\n    raise RuntimeError("pycosat stub")\ndef itersolve(*a, **k):\n    raise RuntimeError("pycosat stub")\n' > $W/site/pycosat/__init__.py; echo "PYCOSAT STUB"; tail -3 $W/pycosat.log; }
export PYTHONPATH=$W/site:$PWD/src
python3 -c "import echotrain.cli, reasoning_gym, transformers, gguf, math_verify, datasets; print('imports ok, transformers', transformers.__version__)" 2>&1 | tail -5
echo "setup took $((SECONDS-T0)) s"
mkdir -p $W/dc; rm -rf $W/dc/optimizers
timeout ${1:-200} python3 -m echotrain.cli device-check --only optimizers --out $W/dc/optimizers > $W/dc/optimizers.log 2>&1; rc=$?; echo "optimizers rc=$rc"
tail -30 $W/dc/optimizers.log
cp $W/dc/optimizers/summary.json ${OUT:-.}/optimizers.json 2>/dev/null; cp $W/dc/optimizers.log ${OUT:-.}/ 2>/dev/null
echo "call 1 took $((SECONDS-T0)) s"
exit $rc
