#!/usr/bin/env bash
# v76's device call (perf.md v76): tree_ab at 8K of HEAD, v76a (the DeltaNet step's fold M slice by cp.async into
# shared memory at MARK 5) and v76t (timing only: no M term); then, if v76a's median is 0.5% or more below HEAD's, the
# landing run (h200-land-run.sh: every GPU test, then ninfer-rt bench of both shapes) in v76a's full tree.
#   here:       bash bench/results/h200-v76-run.sh prepare     # .dbg/ab/v76{a,t}: HEAD's whole tree + each diff
#   the device: bash bench/results/h200-v76-run.sh             # carry [".dbg/ab/v76a", ".dbg/ab/v76t"]
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-/tmp/ninfer-v76}
if [ "${1:-}" = prepare ]; then
  for v in v76a v76t; do
    rm -rf ".dbg/ab/$v" && mkdir -p ".dbg/ab/$v" && git archive HEAD | tar -x -C ".dbg/ab/$v" --exclude=bench/results \
      && git apply --directory=".dbg/ab/$v" bench/results/h200-"$v"-*-prepared.diff || exit 1
  done
  exit 0
fi
mkdir -p "$OUT"
PYTHONPATH=$ROOT timeout 240 python3 .dbg/ab/v76a/bench/tree_ab.py --base-tree "$ROOT" --variant .dbg/ab/v76t \
  --model qwen3.6-35b-a3b --context 8192 --rounds 3 --arch sm_90a --jobs 14 --work "$ROOT/.dbg/abwork" \
  --json "$OUT/v76-ab.json" 2>&1 | tee "$OUT/v76-ab.txt" | tail -8
win=$(python3 - "$OUT/v76-ab.json" <<'PY'
import json, sys
med = {r["tree"]: r["median"] for r in json.load(open(sys.argv[1]))["summary"] if r["context"] == 8192}
print(1 if med.get("new", 9e9) <= 0.995 * med.get("base", 0.0) else 0)
PY
)
[ "$win" = 1 ] || { echo "v76a not 0.5% faster: no landing run"; exit 0; }
(cd .dbg/ab/v76a && OUT=$OUT bash "$ROOT/bench/results/h200-land-run.sh" v76a)
