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
python3 -m pytest -q -rs tests 2>&1 | tee "$out/tests.log" | tail -n 15
python3 scripts/bench_kernels.py --out "$out/kernels.json" 2>&1 | tail -n 3
CACHEDEMB_ROW_COPY=staged python3 scripts/bench_kernels.py --out "$out/kernels_staged.json" 2>&1 | tail -n 3
python3 scripts/bench_embedding_bag.py --rows 1000000 20000000 --out "$out/embedding_bag_step.json" 2>&1 | tail -n 3
python3 scripts/bench_cache_policy.py --traces zipf1.05 criteo --out "$out/cache_policy.json" >/dev/null 2>&1
echo "results in $out"; ls -la "$out"
