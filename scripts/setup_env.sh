#!/usr/bin/env bash
# Create .venv and install cachedemb with its CPU test/recipe dependencies. Idempotent: a stamp holding the
# hash of the requirement files skips the install when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${CACHEDEMB_VENV:-$root/.venv}"
stamp="$venv/.cachedemb-installed"
want="$(cat requirements-cpu.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$venv/bin/python" -m pip install -q -r requirements-cpu.txt
# torchrec's own requirements would pull the CUDA fbgemm-gpu; fbgemm-gpu-cpu above provides fbgemm_gpu.
"$venv/bin/python" -m pip install -q --no-deps 'torchrec==1.8.0'
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
echo "$want" > "$stamp"
