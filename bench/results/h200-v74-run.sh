#!/usr/bin/env bash
# v74's device call (perf.md v73, v74): tree_ab at 8K of HEAD, v73n (timing only: v73 without its atomics, "new"),
# v74 (acc in 8 groups), v73 and v70b; then the landing run (bench/results/h200-land-run.sh: every GPU test, then
# ninfer-rt bench of both shapes) in the full tree of v74 (main + v71..v74) if v74's median is 1% or more below
# v73's, else in v73's. Trees: .dbg/ab/{v73n,v74,v73,v70b} and .dbg/ab/land{73,74}; carry [".dbg/ab"].
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-/tmp/ninfer-v74}
mkdir -p "$OUT"
PYTHONPATH=$ROOT timeout 220 python3 .dbg/ab/v73n/bench/tree_ab.py --base-tree "$ROOT" \
  --variant .dbg/ab/v74 .dbg/ab/v73 .dbg/ab/v70b --model qwen3.6-35b-a3b --context 8192 --rounds 3 --arch sm_90a \
  --jobs 14 --work "$ROOT/.dbg/abwork" --json "$OUT/v74-ab.json" 2>&1 | tee "$OUT/v74-ab.txt" | tail -9
pick=$(python3 - "$OUT/v74-ab.json" <<'PY'
import json, sys
med = {r["tree"]: r["median"] for r in json.load(open(sys.argv[1]))["summary"] if r["context"] == 8192}
print(74 if med.get("v74", 9e9) <= 0.99 * med.get("v73", 0.0) else 73)
PY
)
echo "landing run in land$pick"
(cd ".dbg/ab/land$pick" && OUT=$OUT bash "$ROOT/bench/results/h200-land-run.sh" "v$pick")
