#!/usr/bin/env bash
# A landed change's device call: build the kernels, the whole GPU suite, then ninfer-rt bench of both shipped shapes.
#   on the device, from the checkout (no carry needed):  bash bench/results/h200-land-run.sh TAG
set -uo pipefail
TAG=${1:?usage: h200-land-run.sh TAG}
OUT=${OUT:-/tmp/ninfer-land}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -m ninfer_rt.cli build-kernels --arch sm_90a --jobs 14 2>&1 | tail -1
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -12 | tee "$OUT/$TAG-gpu-tests.txt"
timeout 120 python3 -m ninfer_rt.cli bench --synthetic qwen3.6-35b-a3b --prefill 8192 \
  --decode-context 0,8192,65536,262144 --json "$OUT/$TAG-bench-35b.json" 2>&1 | tail -22
timeout 80 python3 -m ninfer_rt.cli bench --synthetic qwen3.6-27b --prefill 8192 --decode-context 8192 \
  --json "$OUT/$TAG-bench-27b.json" 2>&1 | tail -14
