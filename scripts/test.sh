#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU; Triton kernels run under the interpreter.
# Tests marked slow (soak, long multi-process jobs) run only with --slow.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
# Test files spread over CACHEDEMB_TEST_WORKERS processes (pytest-xdist; default 2, one per core of the CI box;
# 0 runs in this process), a file per worker so module fixtures run once; one torch thread per worker.
workers="${CACHEDEMB_TEST_WORKERS:-2}"
dist=()
if [ "$workers" != "0" ]; then
  dist=(-n "$workers" --dist loadfile)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
fi
exec "${CACHEDEMB_VENV:-$root/.venv}/bin/python" -m pytest -q "${dist[@]}" "$@"
