#!/usr/bin/env bash
# v70's device calls (perf.md v70): timing-only bounds (the outputs are wrong) of the 35B's step without the router
# GEMV (v70a, v54's bound again on today's HEAD) and, on top, with the fused MoE routing and issuing its routed
# gate/up tile before its wait (v70b), as it could if its logits were complete two launches back.
#   here, with git:  bash bench/results/h200-v70-prepared-run.sh prepare   # .dbg/ab/{v70a,v70b}: HEAD + a diff
#   on the device, one call of ~6-8 min with carry=[".dbg/ab"] (not ".dbg": the kernel caches in .dbg/abwork
#   stay there between calls while the machine is warm, and v69's script shares them: cache-base is HEAD's):
#     bash bench/results/h200-v70-prepared-run.sh ab          # tree_ab, 35B at 8K and 64K, 3 rounds
#     bash bench/results/h200-v70-prepared-run.sh timeline    # v70b's fused MoE marks at 8K (if time is left)
#   and, if v70b beats v70a by 3% or more, v71 (the design: the step adds the router's logits, the MoE routes on them
#   before its wait) and v72 (v71, and the attention combine does the same for the other 10 layers), three calls:
#     bash bench/results/h200-v70-prepared-run.sh tests71     # v71's DeltaNet, MoE and engine GPU tests, in its tree
#     bash bench/results/h200-v70-prepared-run.sh tests72     # v72's, with the attention and combine-fold tests
#     bash bench/results/h200-v70-prepared-run.sh ab72        # tree_ab of HEAD, v72, v71 and v70b, 35B at 8K and 64K
#   (each tests call builds its tree's kernels into the cache ab72 gives that tree; ab71 is v71 alone, if v72 fails)
set -uo pipefail
ROOT=$PWD
OUT=${OUT:-/tmp/ninfer-v70}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
VARIANTS="v70a v70b v71"  # and v72: v71's tree with its diff on top
diff_of() { ls "$ROOT"/bench/results/h200-"$1"-*-prepared.diff; }

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
      rm -rf .dbg/ab/v72 && cp -r .dbg/ab/v71 .dbg/ab/v72 && git apply --directory=.dbg/ab/v72 "$(diff_of v72)" || exit 1
      ls .dbg/ab ;;
    ab)  # new = v70a's tree (its tree_ab.py runs), base = this checkout (HEAD), variant v70b
      PYTHONPATH=$ROOT timeout 580 python3 .dbg/ab/v70a/bench/tree_ab.py --base-tree "$ROOT" --variant .dbg/ab/v70b \
        --model qwen3.6-35b-a3b --context 8192 65536 --rounds 3 --arch sm_90a --jobs 14 --work "$ROOT/.dbg/abwork" \
        --json "$OUT/v70-ab.json" 2>&1 | tee "$OUT/v70-ab.txt" | tail -16 ;;
    tests71)
      # cache-v71: the cache ab72's tree_ab gives v71's tree (a variant), so that call finds the kernels built
      (cd .dbg/ab/v71 && PYTHONPATH=$PWD XDG_CACHE_HOME="$ROOT/.dbg/abwork/cache-v71" \
        && export PYTHONPATH XDG_CACHE_HOME \
        && python3 -m ninfer_rt.cli build-kernels --arch sm_90a --jobs 14 2>&1 | tail -1 \
        && timeout 480 python3 -m pytest -q -p no:cacheprovider tests/test_router_fold.py tests/gpu/test_moe_fused.py \
          tests/gpu/test_deltanet.py tests/gpu/test_engine.py -k "router_fold or fused or step or records or greedy" \
          2>&1 | tail -15) | tee "$OUT/tests-v71.txt" ;;
    tests72)  # cache-new: ab72's "new" is v72's tree
      (cd .dbg/ab/v72 && PYTHONPATH=$PWD XDG_CACHE_HOME="$ROOT/.dbg/abwork/cache-new" \
        && export PYTHONPATH XDG_CACHE_HOME \
        && python3 -m ninfer_rt.cli build-kernels --arch sm_90a --jobs 14 2>&1 | tail -1 \
        && timeout 480 python3 -m pytest -q -p no:cacheprovider tests/test_router_fold.py \
          tests/gpu/test_attention_fold.py tests/gpu/test_attention.py tests/gpu/test_attention_records.py \
          tests/gpu/test_moe_fused.py tests/gpu/test_engine.py -k "fold or fast or records or fused or greedy" \
          2>&1 | tail -15) | tee "$OUT/tests-v72.txt" ;;
    ab72)  # new = v72's tree, base = this checkout (HEAD), variants v71 and v70b (the bound), in the same rounds
      PYTHONPATH=$ROOT timeout 580 python3 .dbg/ab/v72/bench/tree_ab.py --base-tree "$ROOT" \
        --variant .dbg/ab/v71 .dbg/ab/v70b --model qwen3.6-35b-a3b --context 8192 65536 --rounds 3 --arch sm_90a \
        --jobs 14 --work "$ROOT/.dbg/abwork" --json "$OUT/v72-ab.json" 2>&1 | tee "$OUT/v72-ab.txt" | tail -20 ;;
    ab71)  # new = v71's tree (rebuilt into cache-new), base = this checkout (HEAD), variant v70b
      PYTHONPATH=$ROOT timeout 580 python3 .dbg/ab/v71/bench/tree_ab.py --base-tree "$ROOT" --variant .dbg/ab/v70b \
        --model qwen3.6-35b-a3b --context 8192 65536 --rounds 3 --arch sm_90a --jobs 14 --work "$ROOT/.dbg/abwork" \
        --json "$OUT/v71-ab.json" 2>&1 | tee "$OUT/v71-ab.txt" | tail -16 ;;
    timeline)
      (cd .dbg/ab/v70b && PYTHONPATH=$PWD XDG_CACHE_HOME="$ROOT/.dbg/abwork/cache-tl70" timeout 300 \
        python3 bench/decode_timeline.py --model qwen3.6-35b-a3b --context 8192 --jobs 14 \
        --json "$OUT/timeline-v70b-8k.json") 2>&1 | tee "$OUT/timeline-v70b-8k.txt" | tail -60 ;;
    *) echo "unknown phase $phase (prepare, ab, timeline, tests71, tests72, ab72, ab71)"; exit 2 ;;
  esac
done
