#!/usr/bin/env bash
# v70's device calls (perf.md v70): timing-only bounds (the outputs are wrong) of the 35B's step without the router
# GEMV (v70a, v54's bound again on today's HEAD) and, on top, with the fused MoE routing and issuing its routed
# gate/up tile before its wait (v70b), as it could if its logits were complete two launches back.
#   here, with git:  bash bench/results/h200-v70-prepared-run.sh prepare   # .dbg/ab/{v70a,v70b}: HEAD + a diff
#   on the device, one call of ~6-8 min with carry=[".dbg/ab"] (not ".dbg": the kernel caches in .dbg/abwork
#   stay there between calls while the machine is warm, and v69's script shares them: cache-base is HEAD's):
#     bash bench/results/h200-v70-prepared-run.sh ab          # tree_ab, 35B at 8K and 64K, 3 rounds
#     bash bench/results/h200-v70-prepared-run.sh timeline    # v70b's fused MoE marks at 8K (if time is left)
#   and, if v70b beats v70a by 3% or more, the design (the step and the attention combine add the router's logits,
#   the MoE routes on them before its wait): v73 = v72 (= v71, the DeltaNet layers, + the attention layers) with the
#   step's fold reads fixed, two calls:
#     bash bench/results/h200-v70-prepared-run.sh tests73     # v73's fold, attention, MoE and engine GPU tests
#     bash bench/results/h200-v70-prepared-run.sh ab73        # tree_ab of HEAD, v73, v72 and v70b, 35B at 8K and 64K
#   (tests73 builds v73's kernels into the cache ab73 gives it). If v73's tests fail: tests72 and ab72 (HEAD, v72,
#   v71, v70b), or tests71 and ab71.
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-/tmp/ninfer-v70}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
VARIANTS="v70a v70b v71"  # then v72 (v71's tree and its diff), v73 (v72's), v73n and v74 (v73's)
diff_of() { ls "$ROOT"/bench/results/h200-"$1"-*-prepared.diff; }
# tree_tests TREE CACHE FILTER FILES...: build TREE's kernels into .dbg/abwork/CACHE, then run its tests matching FILTER
tree_tests() {
  local tree=$1 cache=$2 filter=$3; shift 3
  (cd ".dbg/ab/$tree" && PYTHONPATH=$PWD XDG_CACHE_HOME="$ROOT/.dbg/abwork/$cache" \
    && export PYTHONPATH XDG_CACHE_HOME \
    && python3 -m ninfer_rt.cli build-kernels --arch sm_90a --jobs 14 2>&1 | tail -1 \
    && timeout 480 python3 -m pytest -q -p no:cacheprovider "$@" -k "$filter" 2>&1 | tail -15) \
    | tee "$OUT/tests-$tree.txt"
}
# tree_ab_of TREE VARIANTS...: tree_ab with new = TREE (its tree_ab.py runs), base = this checkout, 35B at 8K and 64K
tree_ab_of() {
  local tree=$1; shift
  PYTHONPATH=$ROOT timeout 580 python3 ".dbg/ab/$tree/bench/tree_ab.py" --base-tree "$ROOT" --variant "$@" \
    --model qwen3.6-35b-a3b --context 8192 65536 --rounds 3 --arch sm_90a --jobs 14 --work "$ROOT/.dbg/abwork" \
    --json "$OUT/$tree-ab.json" 2>&1 | tee "$OUT/$tree-ab.txt" | tail -20
}

for phase in "$@"; do
  case $phase in
    prepare)
      mkdir -p .dbg/ab
      for v in $VARIANTS; do
        rm -rf ".dbg/ab/$v" ".dbg/ab/x-$v"
        python3 bench/tree_ab.py --base HEAD --extract-only --work ".dbg/ab/x-$v" > /dev/null || exit 1
        mv ".dbg/ab/x-$v/base" ".dbg/ab/$v" && rmdir ".dbg/ab/x-$v" && rm -rf ".dbg/ab/$v/bench/results"
        [ "$v" = v71 ] && { git archive HEAD tests | tar -x -C ".dbg/ab/$v"; }  # its tests run in its tree
        git apply --directory=".dbg/ab/$v" "$(diff_of "$v")" || exit 1
      done
      for pair in v71:v72 v72:v73 v73:v73n v73:v74; do
        from=${pair%:*} to=${pair#*:}
        rm -rf ".dbg/ab/$to" && cp -r ".dbg/ab/$from" ".dbg/ab/$to" \
          && git apply --directory=".dbg/ab/$to" "$(diff_of "$to")" || exit 1
      done
      # the full trees a landing run tests (h200-v74-run.sh): HEAD and v71..v73 (land73), .. v74 (land74)
      for t in 73 74; do
        rm -rf ".dbg/ab/land$t" && mkdir -p ".dbg/ab/land$t" \
          && git archive HEAD | tar -x -C ".dbg/ab/land$t" --exclude=bench/results || exit 1
        for v in v71 v72 v73 $([ $t = 74 ] && echo v74); do
          git apply --directory=".dbg/ab/land$t" "$(diff_of "$v")" || exit 1
        done
      done
      ls .dbg/ab ;;
    ab) tree_ab_of v70a .dbg/ab/v70b ;;  # base = this checkout (HEAD), new = v70a, v70b beside
    tests71)  # cache-v71: the cache a later tree_ab gives v71's tree as a variant
      tree_tests v71 cache-v71 "router_fold or fused or step or records or greedy" tests/test_router_fold.py \
        tests/gpu/test_moe_fused.py tests/gpu/test_deltanet.py tests/gpu/test_engine.py ;;
    tests72)  # cache-new: ab72's "new" is v72's tree
      tree_tests v72 cache-new "fold or fast or records or fused or greedy" tests/test_router_fold.py \
        tests/gpu/test_attention_fold.py tests/gpu/test_attention.py tests/gpu/test_attention_records.py \
        tests/gpu/test_moe_fused.py tests/gpu/test_engine.py ;;
    tests73)  # cache-new: ab73's "new" is v73's tree
      tree_tests v73 cache-new "fold or fast or records or step or fused or greedy" tests/test_router_fold.py \
        tests/gpu/test_attention_fold.py tests/gpu/test_attention.py tests/gpu/test_attention_records.py \
        tests/gpu/test_deltanet.py tests/gpu/test_deltanet_fold.py tests/gpu/test_moe_fused.py tests/gpu/test_engine.py ;;
    ab73) tree_ab_of v73 .dbg/ab/v72 .dbg/ab/v70b ;;  # base = this checkout (HEAD); v72 and the bound beside
    ab72) tree_ab_of v72 .dbg/ab/v71 .dbg/ab/v70b ;;
    ab71) tree_ab_of v71 .dbg/ab/v70b ;;  # v71 rebuilt into cache-new
    timeline)
      (cd .dbg/ab/v70b && PYTHONPATH=$PWD XDG_CACHE_HOME="$ROOT/.dbg/abwork/cache-tl70" timeout 300 \
        python3 bench/decode_timeline.py --model qwen3.6-35b-a3b --context 8192 --jobs 14 \
        --json "$OUT/timeline-v70b-8k.json") 2>&1 | tee "$OUT/timeline-v70b-8k.txt" | tail -60 ;;
    *) echo "unknown phase $phase (prepare, ab, timeline, tests73, ab73, tests72, ab72, tests71, ab71)"; exit 2 ;;
  esac
done
