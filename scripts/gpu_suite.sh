#!/usr/bin/env bash
# One call on a CUDA machine (offline, torch + triton preinstalled): install the tree, run the GPU tests and every
# benchmark, and write JSON/logs under ${OUT:-benchmarks/results/gpu}. Usage: bash scripts/gpu_suite.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/benchmarks/results/gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || cat "$out/install.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/device.txt" 2>&1
# The whole suite: GPU-only tests and the kernels' CUDA cases run; interpreter-only cases skip themselves.
# xdist workers share the 16 cores: keep each to 2 threads (oversubscription made CPU tests time out).
xdist=""; python3 -c "import xdist" 2>/dev/null && xdist="-n 8" && export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
timeout 420 python3 -m pytest -q -rs $xdist -p no:cacheprovider --timeout 240 tests 2>&1 | tee "$out/tests.log" | tail -n 15
timeout 120 python3 scripts/bench_kernels.py --out "$out/kernels.json" 2>&1 | tail -n 3
CACHEDEMB_ROW_COPY=staged timeout 120 python3 scripts/bench_kernels.py --out "$out/kernels_staged.json" 2>&1 | tail -n 3
# 1% caches: at 20M rows the 200k-row cache holds a batch's ~135k distinct ids (at 1M rows it cannot).
timeout 150 python3 scripts/bench_embedding_bag.py --rows 20000000 --steps 12 --warmup 4 --out "$out/embedding_bag_step.json" 2>&1 | tail -n 12
timeout 150 python3 scripts/bench_embedding_bag.py --rows 20000000 --steps 12 --warmup 4 --prefetch 4 --skip-reference --out "$out/embedding_bag_step_prefetch.json" 2>&1 | tail -n 8
echo "results in $out"; ls -la "$out"
