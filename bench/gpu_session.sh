#!/usr/bin/env bash
# One device call: build the kernels for this GPU, run the GPU tests, then the benchmarks; logs under $OUT.
#   bash bench/gpu_session.sh [tests | tests:K/N] [kernels] [bench35] [bench27]   (default: tests kernels bench35 bench27)
# tests:K/N runs the K-th of N contiguous parts of the GPU suite (tests/conftest.py's --shard): the whole suite took
# ~500 s on an H100 (perf.md v116), so with the build it fits one 600 s call only in two parts, e.g. tests:1/2 then
# tests:2/2 on the same warm machine (its kernel cache stays).
# Run from the checkout with PYTHONPATH=$PWD on a machine with a GPU, nvcc and the Python packages.
set -uo pipefail
OUT=${OUT:-/tmp/ninfer-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
phases=${*:-tests kernels bench35 bench27}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
arch=$(python3 -c "from ninfer_rt.gpu.driver import Gpu; print(Gpu().info.arch)")
time python3 -m ninfer_rt build-kernels --arch "$arch" --jobs 16 2>&1 | tail -3
for p in $phases; do
  case $p in
    tests)   timeout 540 python3 -m pytest tests/gpu -q -p no:cacheprovider -rfs --durations=20 2>&1 \
               | tee "$OUT/tests.log" | tail -60 ;;
    tests:*) shard=${p#tests:}
             timeout 540 python3 -m pytest tests/gpu -q -p no:cacheprovider -rfs --durations=20 --shard "$shard" 2>&1 \
               | tee "$OUT/tests-${shard/\//of}.log" | tail -60 ;;
    kernels) timeout 200 python3 bench/gemv_bench.py --json "$OUT/gemv.json" 2>&1 | tail -30
             timeout 200 python3 bench/gemm_bench.py --json "$OUT/gemm.json" 2>&1 | tail -20 ;;
    bench35) timeout 400 python3 -m ninfer_rt bench --synthetic qwen3.6-35b-a3b --json "$OUT/bench-35b.json" \
               --prefill 512,8192,65536 --decode-context 0,8192,65536,262144 2>&1 | tail -30 ;;
    bench27) timeout 300 python3 -m ninfer_rt bench --synthetic qwen3.6-27b --json "$OUT/bench-27b.json" \
               --prefill 512,8192 --decode-context 0,8192 2>&1 | tail -30 ;;
  esac
done
