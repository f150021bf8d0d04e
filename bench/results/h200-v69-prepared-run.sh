#!/usr/bin/env bash
# v69's device calls (perf.md v69): the int8 decode with fewer instructions a key (v69a) and, on top, p·v on fp16
# (v69b), each against HEAD's kernels.
#   here, with git:  bash bench/results/h200-v69-prepared-run.sh prepare   # .dbg/ab/{v69a,v69b}: HEAD + a diff
#                    (3.5 MB to carry; the kernels build there: a tree's sm_90a cache is ~45 MB)
#   on the device, four calls of ~5-8 min, each with carry=[".dbg/ab"] (the kernel caches in .dbg/abwork stay):
#     bash bench/results/h200-v69-prepared-run.sh ab35      # tree_ab, 35B at 8K, 64K and 262,143, 2 rounds
#     bash bench/results/h200-v69-prepared-run.sh tests-v69b     # a variant's attention and engine GPU tests
#     bash bench/results/h200-v69-prepared-run.sh tests-v69a
#     bash bench/results/h200-v69-prepared-run.sh ab27 planner timeline   # tree_ab, 27B at 8K; v69b's attention
#       splits swept (a faster step may want fewer, longer splits) and its decode marks, 35B at 8K
# tests run inside the variant's tree (cwd first on sys.path): its ninfer_rt, kernels and tests. Kernel caches stay
# under .dbg while the machine is warm; logs go to $OUT.
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-/tmp/ninfer-v69}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
VARIANTS="v69a v69b"
diff_of() { ls "$ROOT"/bench/results/h200-"$1"-*-prepared.diff; }
# in_tree V CACHE CMD...: CMD inside variant V's tree, its ninfer_rt on the path, kernels cached in .dbg/abwork/CACHE
# (tree_ab's names: cache-new is v69a's, whose tree_ab.py runs, cache-v69b and cache-base)
in_tree() { local v=$1 c=$2; shift 2; (cd ".dbg/ab/$v" && PYTHONPATH=$PWD XDG_CACHE_HOME="$ROOT/.dbg/abwork/$c" "$@"); }
cache_of() { [ "$1" = v69a ] && echo cache-new || echo "cache-$1"; }

for phase in "$@"; do
  case $phase in
    prepare)
      mkdir -p .dbg/ab
      for v in $VARIANTS; do
        rm -rf ".dbg/ab/$v" ".dbg/ab/x-$v"  # only this run's trees: v70's live beside them
        python3 bench/tree_ab.py --base HEAD --extract-only --work ".dbg/ab/x-$v" > /dev/null || exit 1
        mv ".dbg/ab/x-$v/base" ".dbg/ab/$v" && rmdir ".dbg/ab/x-$v" && rm -rf ".dbg/ab/$v/bench/results"
        git archive HEAD tests | tar -x -C ".dbg/ab/$v"  # the variant's tests run from its own tree
        git apply --directory=".dbg/ab/$v" "$(diff_of "$v")" || exit 1
      done
      ls .dbg/ab ;;
    tests-*)  # inside the variant's tree: its ninfer_rt, kernels and tests (cwd first on sys.path)
      v=${phase#tests-}
      { in_tree "$v" "$(cache_of "$v")" python3 -m ninfer_rt.cli build-kernels --arch sm_90a --jobs 14 2>&1 | tail -1
        in_tree "$v" "$(cache_of "$v")" timeout 450 python3 -m pytest -q -p no:cacheprovider \
          tests/gpu/test_{attention,attention_records,engine}.py 2>&1 | tail -15; } | tee "$OUT/tests-$v.txt" ;;
    ab35|ab27)
      if [ "$phase" = ab35 ]; then args="--model qwen3.6-35b-a3b --context 8192 65536 262143"
      else args="--model qwen3.6-27b --context 8192"; fi
      PYTHONPATH=$ROOT timeout 560 python3 .dbg/ab/v69a/bench/tree_ab.py --base-tree "$ROOT" --variant .dbg/ab/v69b \
        $args --rounds 2 --arch sm_90a --jobs 14 --work "$ROOT/.dbg/abwork" --json "$OUT/$phase.json" 2>&1 \
        | tee "$OUT/$phase.txt" | tail -16 ;;
    planner)
      in_tree v69b cache-v69b timeout 300 python3 bench/planner_ab.py --model qwen3.6-35b-a3b --context 8192 65536 \
        --only "attention splits" --json "$OUT/planner-v69b.json" 2>&1 | tee "$OUT/planner-v69b.txt" | tail -20 ;;
    timeline)
      in_tree v69b cache-tl timeout 300 python3 bench/decode_timeline.py --model qwen3.6-35b-a3b --context 8192 \
        --jobs 14 --json "$OUT/timeline-v69b-8k.json" 2>&1 | tee "$OUT/timeline-v69b-8k.txt" | tail -60 ;;
    *) echo "unknown phase $phase (prepare, ab35, tests-VARIANT, ab27, planner, timeline)"; exit 2 ;;
  esac
done
