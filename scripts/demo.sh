#!/usr/bin/env bash
# The README's first command: set up .venv, then train DLRM on a built-in synthetic Criteo-format data set
# (planted-signal labels, Zipf ids) with every embedding table behind a 1% cache, and print AUC, samples/s and
# the cache hit rate. About 2-3 minutes on 2 CPU cores after setup. Extra arguments go to cachedemb.recipes.dlrm.main.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup_env.sh
venv="${CACHEDEMB_VENV:-$root/.venv}"
start=$SECONDS
# Generates data/synthetic/criteo_400000rows/train.txt once (reused later), preprocesses it to memmapped .npy,
# trains one epoch (embedding dim 16, batch 2048, row-wise Adagrad, 1% cache, look-ahead prefetch of 4 batches with
# a 16-batch id horizon) and evaluates on the val split. Progress bars go to stderr; the summary (AUC, samples/s,
# hit rate, rows moved, time) to stdout, and every figure to demo_metrics.json beside the data.
data_dir="${DEMO_DATA_DIR:-data/synthetic}"
"$venv/bin/python" -m cachedemb.recipes.dlrm.main --data synthetic --data-dir "$data_dir" \
  --synthetic-samples 400000 --embedding-dim 16 --batch-size 2048 --epochs 1 --cache-ratio 0.01 \
  --prefetch-depth 4 --prefetch-horizon 16 --log-every 25 --metrics-file "$data_dir/demo_metrics.json" "$@"
echo "demo: finished in $((SECONDS - start)) s"
