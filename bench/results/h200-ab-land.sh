#!/usr/bin/env bash
# One device call for prepared kernel variants: tree_ab of HEAD against each (the 35B at 8K, 3 rounds), then the
# landing run (h200-land-run.sh: every GPU test, then ninfer-rt bench of both shapes) in the fastest variant's full
# tree if its median is 0.5% or more below HEAD's. A variant V is HEAD's whole tree plus
# bench/results/h200-V-*-prepared.diff; a variant named A_B stacks B's diff on A's tree.
#   here:       bash bench/results/h200-ab-land.sh prepare v77a [v77b ...]   # .dbg/ab/V for each
#   the device: bash bench/results/h200-ab-land.sh run v77a [v77b ...]       # carry [".dbg/ab/V", ...]
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-/tmp/ninfer-ab}
phase=${1:?usage: h200-ab-land.sh prepare|run VARIANT...}; shift
[ $# -ge 1 ] || { echo "name at least one variant"; exit 2; }
if [ "$phase" = prepare ]; then
  for v in "$@"; do
    rm -rf ".dbg/ab/$v" && mkdir -p ".dbg/ab/$v" \
      && git archive HEAD | tar -x -C ".dbg/ab/$v" --exclude=bench/results || exit 1
    IFS=_ read -ra parts <<< "$v"
    for p in "${parts[@]}"; do
      git apply --directory=".dbg/ab/$v" bench/results/h200-"$p"-*-prepared.diff || exit 1
    done
  done
  exit 0
fi
[ "$phase" = run ] || { echo "unknown phase $phase (prepare, run)"; exit 2; }
mkdir -p "$OUT"
first=$1; shift
PYTHONPATH=$ROOT timeout 300 python3 ".dbg/ab/$first/bench/tree_ab.py" --base-tree "$ROOT" \
  ${1:+--variant $(printf '.dbg/ab/%s ' "$@")} --model qwen3.6-35b-a3b --context 8192 --rounds 3 --arch sm_90a \
  --jobs 14 --work "$ROOT/.dbg/abwork" --json "$OUT/ab.json" 2>&1 | tee "$OUT/ab.txt" | tail -$((8 + $#))
pick=$(python3 - "$OUT/ab.json" "$first" <<'PY'
import json, sys
med = {r["tree"]: r["median"] for r in json.load(open(sys.argv[1]))["summary"] if r["context"] == 8192}
med[sys.argv[2]] = med.pop("new", 9e9)  # tree_ab names the tree it runs from "new"
base = med.pop("base", 0.0)
tree, ms = min(med.items(), key=lambda t: t[1])
print(tree if ms <= 0.995 * base else "none")
PY
)
[ "$pick" != none ] || { echo "no variant 0.5% faster: no landing run"; exit 0; }
echo "landing run in $pick"
(cd ".dbg/ab/$pick" && OUT=$OUT bash "$ROOT/bench/results/h200-land-run.sh" "$pick")
