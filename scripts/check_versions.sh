#!/usr/bin/env bash
# The supported torch/Triton range, tried as a new user would: for the oldest supported torch and the newest
# release, a fresh venv gets that torch, the Triton it pins and this package's `test` extra, then the suite runs on
# CPU with the kernels under TRITON_INTERPRET=1. Figures go to benchmarks/results/compat.json (entries of the
# environments run replace the old ones; the others are kept).
#
#   bash scripts/check_versions.sh                  # both ends (~5 GB and ~5 min each on 2 cores)
#   bash scripts/check_versions.sh oldest           # one end
#   bash scripts/check_versions.sh --keep           # keep the venvs (their paths are printed)
#   bash scripts/check_versions.sh --ref HEAD       # test a commit (exported to the temp dir), not the work tree
#
# The install builds the C helpers (CACHEDEMB_REQUIRE_NATIVE=1: without a compiler it fails instead of installing
# the pure paths), and the suite runs with CI=true (it fails unless they load). Exits 1 when a suite had failures or
# errors (after writing the file). torchrec / fbgemm are left out: their tests skip themselves.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"  # 3.11+ (tomllib); also the venvs' Python
out="$root/benchmarks/results/compat.json"

# label, torch, the triton that torch's CUDA build pins, numpy. Triton's interpreter before 3.4 reads garbage
# from numpy 2 arrays, hence numpy<2 there.
MATRIX=(
  "oldest 2.5.1 3.1.0 numpy<2"
  "newest 2.15.0 3.9.0 numpy"
)

keep=0
ref=""
want=()
while [ $# -gt 0 ]; do
  case "$1" in
    --keep) keep=1 ;;
    --ref) ref="$2"; shift ;;
    oldest|newest) want+=("$1") ;;
    *) echo "usage: $0 [--keep] [--ref REF] [oldest|newest ...]" >&2; exit 2 ;;
  esac
  shift
done
[ ${#want[@]} -gt 0 ] || want=(oldest newest)

work="$(mktemp -d "${TMPDIR:-/tmp}/cachedemb-compat.XXXXXX")"
cleanup() { [ "$keep" = 1 ] || rm -rf "$work"; }
trap cleanup EXIT
# The machine's pip may carry a constraints file capping torch; a fresh user environment has none.
: > "$work/no-constraints.txt"
export PIP_CONSTRAINT="$work/no-constraints.txt" PIP_DISABLE_PIP_VERSION_CHECK=1

src="$root"
source_desc="work tree at $(git -C "$root" rev-parse --short HEAD)"
[ -z "$(git -C "$root" status --porcelain --untracked-files=no)" ] ||
  source_desc="$source_desc (with uncommitted changes)"
if [ -n "$ref" ]; then
  src="$work/src"
  mkdir -p "$src"
  git -C "$root" archive "$ref" | tar -x -C "$src"
  source_desc="$ref ($(git -C "$root" rev-parse --short "$ref"))"
fi

mapfile -t test_reqs < <("$python" - "$root/pyproject.toml" <<'EOF'
import sys, tomllib
extras = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]
print("\n".join(extras["test"]))
EOF
)

results="$work/results.jsonl"
: > "$results"
status=0
for row in "${MATRIX[@]}"; do
  read -r label torch_v triton_v numpy_spec <<< "$row"
  [[ " ${want[*]} " == *" $label "* ]] || continue
  env="$work/venv-$label"
  echo "== $label: torch $torch_v, triton $triton_v, $numpy_spec ($env)"
  t0=$SECONDS
  "$python" -m venv "$env"
  if ! "$env/bin/pip" install -q "torch==$torch_v" "triton==$triton_v" "$numpy_spec" "${test_reqs[@]}" \
       > "$work/install-$label.log" 2>&1 ||
     ! CACHEDEMB_REQUIRE_NATIVE=1 "$env/bin/pip" install -q --no-deps -e "$src" >> "$work/install-$label.log" 2>&1; then
    grep -v '^WARNING: Location' "$work/install-$label.log" | tail -20 >&2
    echo "$label: install failed" >&2
    exit 1
  fi
  install_s=$((SECONDS - t0))
  t0=$SECONDS
  rc=0
  # CI=true: the session fails unless the C helpers loaded (the install above built them with build isolation).
  (cd "$src" && CI=true TRITON_INTERPRET=1 "$env/bin/python" -m pytest -q -p no:cacheprovider -o junit_family=xunit1 \
     --junitxml="$work/junit-$label.xml" tests > "$work/pytest-$label.log" 2>&1) || rc=$?
  test_s=$((SECONDS - t0))
  tail -3 "$work/pytest-$label.log"
  [ "$rc" = 0 ] || status=1
  "$env/bin/python" - "$label" "$work/junit-$label.xml" "$install_s" "$test_s" "$rc" "$source_desc" \
    >> "$results" <<'EOF'
import collections, datetime, json, os, platform, re, sys
import xml.etree.ElementTree as ET

import numpy, torch, triton

label, junit, install_s, test_s, rc, source = sys.argv[1:]
counts = dict(passed=0, failed=0, skipped=0, errors=0)
failing, sites = [], collections.Counter()
if not os.path.exists(junit):  # pytest itself died (e.g. a kernel corrupted memory): no per-test figures
    counts = dict.fromkeys(counts)
for case in ET.parse(junit).getroot().iter("testcase") if os.path.exists(junit) else ():
    kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), None)
    counts[{"failure": "failed", "error": "errors", "skipped": "skipped", None: "passed"}[kind]] += 1
    if kind in ("failure", "error"):
        path = case.get("file", "")
        module = path[:-3].replace("/", ".")
        owner = case.get("classname", "")[len(module) + 1:]
        failing.append("::".join(p for p in (path, owner, case.get("name")) if p))
        # where it broke: in the root cause (pytest prints chained exceptions cause first), the innermost frame
        # in the library (kernels/, cachedemb/), else the innermost one
        cause = re.split(r"\n(?:The above exception|During handling of the above)", case.find(kind).text or "")[0]
        frames = re.findall(r"^(\S+\.py):(\d+): ", cause, re.M)
        ours = [f for f in frames if "site-packages" not in f[0] and not f[0].startswith(("tests/", "/"))]
        if frames:
            sites[":".join((ours or frames)[-1])] += 1
print(json.dumps(dict(label=label, source=source, date=datetime.date.today().isoformat(), torch=torch.__version__,
                      triton=triton.__version__, numpy=numpy.__version__, python=platform.python_version(),
                      **counts, seconds=int(test_s), install_seconds=int(install_s), pytest_exit=int(rc),
                      failure_sites=dict(sites.most_common(10)), failing=failing[:30])))
EOF
  if [ "$keep" = 1 ]; then
    echo "kept $env"
  else
    rm -rf "$env"
  fi
done

"$python" - "$out" "$results" <<'EOF'
import json, os, sys

out, results = sys.argv[1:]
new = [json.loads(line) for line in open(results)]
old = json.load(open(out)).get("environments", []) if os.path.exists(out) else []
order = {"oldest": 0, "newest": 1}
envs = {e["label"]: e for e in old} | {e["label"]: e for e in new}
doc = {
    "what": "the test suite in fresh venvs (torch, its pinned triton, the `test` extra; no torchrec/fbgemm), "
            "on CPU with the Triton kernels under TRITON_INTERPRET=1: scripts/check_versions.sh",
    "cpu_cores": os.cpu_count(),
    "environments": sorted(envs.values(), key=lambda e: order.get(e["label"], 9)),
}
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
print(f"wrote {out}")
EOF
exit "$status"
