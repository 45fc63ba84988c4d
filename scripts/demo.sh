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
# a 16-batch id horizon) and evaluates on the val split.
"$venv/bin/python" -m cachedemb.recipes.dlrm.main --data synthetic --data-dir "${DEMO_DATA_DIR:-data/synthetic}" \
  --synthetic-rows 400000 --embedding-dim 16 --batch-size 2048 --epochs 1 --cache-ratio 0.01 \
  --prefetch-depth 4 --prefetch-horizon 16 --log-every 25 "$@" | tee /dev/stderr | tail -n 1 | "$venv/bin/python" -c "
import json, sys
m = json.loads(sys.stdin.read())
print('demo: AUC %.4f  logloss %.4f  accuracy %.4f  %.0f samples/s  cache hit rate %.3f (1%% cache)'
      % (m['auc'], m['logloss'], m['accuracy'], m['samples_per_s'], m['cache_hit_rate']))"
echo "demo: finished in $((SECONDS - start)) s"
