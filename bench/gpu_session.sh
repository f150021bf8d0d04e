#!/usr/bin/env bash
# One device call: build the kernels for this GPU, run the GPU tests, then the benchmarks; logs under $OUT.
#   bash bench/gpu_session.sh [tests] [kernels] [bench35] [bench27]   (default: all four)
# Run from the checkout with PYTHONPATH=$PWD on a machine with a GPU, nvcc and the Python packages.
set -uo pipefail
OUT=${OUT:-/tmp/ninfer-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
phases=${*:-tests kernels bench35 bench27}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
arch=$(python3 -c "from ninfer_rt.gpu.driver import Gpu; print(Gpu().info.arch)")
time python3 -m ninfer_rt build-kernels --arch "$arch" --jobs 8 2>&1 | tail -3
for p in $phases; do
  case $p in
    tests)   timeout 400 python3 -m pytest tests/gpu -q -x -p no:cacheprovider -rs 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    tests-all) timeout 500 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -60 ;;
    kernels) timeout 200 python3 bench/gemv_bench.py --json "$OUT/gemv.json" 2>&1 | tail -30
             timeout 200 python3 bench/gemm_bench.py --json "$OUT/gemm.json" 2>&1 | tail -20 ;;
    bench35) timeout 400 python3 -m ninfer_rt bench --synthetic qwen3.6-35b-a3b --json "$OUT/bench-35b.json" \
               --prefill 512,8192,65536 --decode-context 0,8192,65536,262144 2>&1 | tail -30 ;;
    bench27) timeout 300 python3 -m ninfer_rt bench --synthetic qwen3.6-27b --json "$OUT/bench-27b.json" \
               --prefill 512,8192 --decode-context 0,8192 2>&1 | tail -30 ;;
  esac
done
