#!/usr/bin/env bash
# v76's device call (perf.md v76): tree_ab at 8K of HEAD, v76a (the DeltaNet step's fold M slice by cp.async into
# shared memory at MARK 5), v76c (v76a and the attention combine's fold columns by cp.async before its wait) and v76t
# (timing only: no M term); then the landing run (h200-land-run.sh: every GPU test, then ninfer-rt bench of both
# shapes) in the full tree of the faster of v76a and v76c, if it is 0.5% or more below HEAD's median.
#   here:       bash bench/results/h200-v76-run.sh prepare     # .dbg/ab/v76{a,c,t}: HEAD's whole tree + the diffs
#   the device: bash bench/results/h200-v76-run.sh             # carry [".dbg/ab/v76a", ".dbg/ab/v76c", ".dbg/ab/v76t"]
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-/tmp/ninfer-v76}
if [ "${1:-}" = prepare ]; then
  for v in v76a v76t; do
    rm -rf ".dbg/ab/$v" && mkdir -p ".dbg/ab/$v" && git archive HEAD | tar -x -C ".dbg/ab/$v" --exclude=bench/results \
      && git apply --directory=".dbg/ab/$v" bench/results/h200-"$v"-*-prepared.diff || exit 1
  done
  rm -rf .dbg/ab/v76c && cp -r .dbg/ab/v76a .dbg/ab/v76c \
    && git apply --directory=.dbg/ab/v76c bench/results/h200-v76c-*-prepared.diff || exit 1
  exit 0
fi
mkdir -p "$OUT"
PYTHONPATH=$ROOT timeout 280 python3 .dbg/ab/v76a/bench/tree_ab.py --base-tree "$ROOT" --variant .dbg/ab/v76c .dbg/ab/v76t \
  --model qwen3.6-35b-a3b --context 8192 --rounds 3 --arch sm_90a --jobs 14 --work "$ROOT/.dbg/abwork" \
  --json "$OUT/v76-ab.json" 2>&1 | tee "$OUT/v76-ab.txt" | tail -11
pick=$(python3 - "$OUT/v76-ab.json" <<'PY'
import json, sys
med = {r["tree"]: r["median"] for r in json.load(open(sys.argv[1]))["summary"] if r["context"] == 8192}
best = min(("v76a", med.get("new", 9e9)), ("v76c", med.get("v76c", 9e9)), key=lambda t: t[1])
print(best[0] if best[1] <= 0.995 * med.get("base", 0.0) else "none")
PY
)
[ "$pick" != none ] || { echo "neither v76a nor v76c 0.5% faster: no landing run"; exit 0; }
echo "landing run in $pick"
(cd ".dbg/ab/$pick" && OUT=$OUT bash "$ROOT/bench/results/h200-land-run.sh" "$pick")
