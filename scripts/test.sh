#!/usr/bin/env bash
# Set up (if needed) and run the test suite on CPU; Triton kernels run under the interpreter.
# Tests marked slow (soak, long multi-process jobs) run only with --slow.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
exec "${CACHEDEMB_VENV:-$root/.venv}/bin/python" -m pytest -q "$@"
