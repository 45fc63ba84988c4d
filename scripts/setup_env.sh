#!/usr/bin/env bash
# Create .venv and install cachedemb with its CPU test/recipe dependencies. Idempotent: a stamp holding the
# hash of the requirement files skips the dependencies when nothing changed, and another, holding the hash of
# setup.py and the C sources, the editable install that builds the C helpers (cachedemb/_native*.so).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${CACHEDEMB_VENV:-$root/.venv}"
stamp="$venv/.cachedemb-installed"
native_stamp="$venv/.cachedemb-native"
want="$(cat requirements-cpu.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
want_native="$(cat pyproject.toml setup.py $(git ls-files '*.c' '*.h' 2>/dev/null || find cachedemb kernels -name '*.[ch]' | sort) | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f "$native_stamp" ] &&
   [ "$(cat "$native_stamp")" = "$want_native" ]; then
  exit 0
fi
if ! [ -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$venv/bin/python" -m pip install -q -r requirements-cpu.txt
  # torchrec's own requirements would pull the CUDA fbgemm-gpu; fbgemm-gpu-cpu above provides fbgemm_gpu.
  "$venv/bin/python" -m pip install -q --no-deps 'torchrec==1.8.0'
fi
# The editable install runs setup.py's build_ext: the C helpers' library lands in cachedemb/ (no compiler: it
# installs without it, and the line below says so). setuptools comes from the venv (--no-build-isolation).
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
"$venv/bin/python" -c "from cachedemb.kernels import native; print('cachedemb C helpers:', native.status())"
echo "$want" > "$stamp"
echo "$want_native" > "$native_stamp"
