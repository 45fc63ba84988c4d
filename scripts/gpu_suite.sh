#!/usr/bin/env bash
# The GPU tests and every benchmark on a CUDA machine (offline, torch + triton preinstalled), in stages that each
# fit one call of a lent machine (600 s a command); JSON/logs go under ${OUT:-benchmarks/results/gpu}.
#
#   bash scripts/gpu_suite.sh STAGE [STAGE...]     run these stages in order (each installs the tree first)
#   bash scripts/gpu_suite.sh all                  every stage in order (where no per-call limit applies)
#   bash scripts/gpu_suite.sh                      print the stages
#
# Stages and their time limits (the limits of one stage sum to < 600 s, install included):
#   tests    the whole test suite: GPU-only tests and the kernels' CUDA cases run    (420 s)
#   kernels  bench_kernels.py, zero-copy and staged row copies                        (120 + 120 s)
#   step     bench_embedding_bag.py at 20M rows: 1% cache vs the table in GPU memory, with prefetch
#            (read-ahead on the GPU, then on the host), step time vs cache rows 50k-4M, and
#            profile_step.py's kernels / host ops / runtime calls       (120 + 90 + 90 + 150 + 90 s)
#   quick    for a lease of 15 device minutes: one command of <= 9 minutes (install + parts <= 500 s); each part
#            under its own timeout, its log and exit status in OUT; a failing or timed-out part's log printed
#            whole; then scripts/gpu_quick_report.py writes OUT/quick.json. Parts (seconds):
#              tests_gpu      pytest -m gpu (the GPU-only tests)                                        100
#              row_move       bench_kernels.py --row-move (in/out/both, 256/512 B, registered/pinned)    75
#              step           bench_embedding_bag.py, 1% cache vs the table in GPU memory                 70
#              step_prefetch  the same with prefetch(depth=4)                                             50
#              two_rank       scripts/gpu_two_rank.py: 2 gloo ranks on the one GPU == one process          45
#              peers          bench_peers.py --peers colossalai (where its wheel is carried in .whl)       50
#              profile        profile_step.py (0 and 4)                                                   60
#              report         gpu_quick_report.py: one JSON, gpu_model.py's prediction beside each step   15
#   --dry-run (before the stages): print what would run, run nothing
#   peers    bench_peers.py at 20M rows, 1% cache: nn.EmbeddingBag in GPU memory, ColossalAI, FBGEMM's UVM
#            cache, cachedemb with and without prefetch (JSON + PNG); installs the peers' wheels first from
#            the folders in PEER_WHEELS (default .whl; scripts/fetch_peer_wheels.sh)          (120 + 420 s)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 1
STAGES=(tests kernels step peers)  # `quick` stands apart: a subset of tests + step, for short leases

usage() {
    sed -n '2,/^set /p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'
}

setup() {
    out="${OUT:-$root/benchmarks/results/gpu}"
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || cat "$out/install.log"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/device.txt" 2>&1
}

stage_tests() {
    # Interpreter-only cases skip themselves. xdist workers share the 16 cores: keep each to 2 threads
    # (oversubscription made CPU tests time out).
    local xdist=()
    python3 -c "import xdist" 2>/dev/null && xdist=(-n 8) && export OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
    timeout 420 python3 -m pytest -q -rs "${xdist[@]}" -p no:cacheprovider --timeout 240 tests 2>&1 | tee "$out/tests.log" | tail -n 15
}

stage_kernels() {
    timeout 120 python3 scripts/bench_kernels.py --out "$out/kernels.json" 2>&1 | tail -n 3
    CACHEDEMB_ROW_COPY=staged timeout 120 python3 scripts/bench_kernels.py --out "$out/kernels_staged.json" 2>&1 | tail -n 3
}

stage_step() {
    # 1% caches: at 20M rows the 200k-row cache holds a batch's ~135k distinct ids (at 1M rows it cannot).
    timeout 120 python3 scripts/bench_embedding_bag.py --rows 20000000 --steps 12 --warmup 6 --out "$out/embedding_bag_step.json" 2>&1 | tail -n 12
    timeout 90 python3 scripts/bench_embedding_bag.py --rows 20000000 --steps 12 --warmup 6 --prefetch 4 --skip-reference --out "$out/embedding_bag_step_prefetch.json" 2>&1 | tail -n 8
    CACHEDEMB_READ_AHEAD=host timeout 90 python3 scripts/bench_embedding_bag.py --rows 20000000 --steps 12 --warmup 6 --prefetch 4 --skip-reference --out "$out/embedding_bag_step_prefetch_host_read_ahead.json" 2>&1 | tail -n 8
    # issue 12: per-batch cost follows the batch, not the cache (4M-row cache <= 1.2x the 200k-row one)
    timeout 150 python3 scripts/bench_embedding_bag.py --rows 20000000 --steps 12 --warmup 4 --batch 4096 --cache-rows 50000 200000 1000000 4000000 --skip-reference --out "$out/embedding_bag_cache_rows.json" 2>&1 | tail -n 8
    timeout 90 python3 scripts/profile_step.py --out "$out/profile_step.json" > "$out/profile_step.log" 2>&1; tail -n 3 "$out/profile_step.log"
}

QUICK_PARTS=(tests_gpu row_move step step_prefetch two_rank peers profile report)
declare -A QUICK_LIMIT=([tests_gpu]=100 [row_move]=75 [step]=70 [step_prefetch]=50 [two_rank]=45 [peers]=50
                        [profile]=60 [report]=15)

quick_command() {
    # the command line of one quick part (printed by --dry-run, run by stage_quick)
    local bench="python3 scripts/bench_embedding_bag.py --rows 20000000 --steps 12 --warmup 6"
    case "$1" in
        tests_gpu) echo "python3 -m pytest -q -m gpu -rfE --tb=short -p no:cacheprovider tests" ;;
        row_move) echo "python3 scripts/bench_kernels.py --row-move --out $out/row_move.json" ;;
        step) echo "$bench --out $out/embedding_bag_step.json" ;;
        step_prefetch) echo "$bench --prefetch 4 --skip-reference --out $out/embedding_bag_step_prefetch.json" ;;
        two_rank) echo "python3 scripts/gpu_two_rank.py --device cuda --timeout 40 --out $out/two_rank.json" ;;
        peers) echo "python3 scripts/bench_peers.py --peers colossalai --steps 12 --out $out/peers.json" ;;
        profile) echo "python3 scripts/profile_step.py --out $out/profile_step.json" ;;
        report) echo "python3 scripts/gpu_quick_report.py $out" ;;
    esac
}

quick_peer_wheels() {
    # ColossalAI's wheel, where carried (scripts/fetch_peer_wheels.sh), into a target folder on PYTHONPATH
    local site=/tmp/peer_site wheels=()
    for first in "${PEER_WHEELS:-.whl}"/*.whl; do
        [ -e "$first" ] && wheels+=("$first")
    done
    [ ${#wheels[@]} -gt 0 ] || return 1
    timeout 30 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}" >"$out/peers_install.log" 2>&1 || return 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
}

stage_quick() {
    local part rc cmd
    git -C "$root" describe --always --dirty >"$out/git.txt" 2>/dev/null || echo unknown >"$out/git.txt"
    for part in "${QUICK_PARTS[@]}"; do
        cmd="$(quick_command "$part")"
        if [ "$part" = peers ] && ! quick_peer_wheels; then
            echo "== $part: skipped (no colossalai wheel in ${PEER_WHEELS:-.whl}; scripts/fetch_peer_wheels.sh)"
            continue
        fi
        echo "== $part (limit ${QUICK_LIMIT[$part]} s): $cmd"
        # shellcheck disable=SC2086  # the command line is split into words on purpose
        timeout -k 5 "${QUICK_LIMIT[$part]}" $cmd >"$out/$part.log" 2>&1
        rc=$?
        echo "$rc" >"$out/$part.rc"
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
            echo "!! $part TIMED OUT after ${QUICK_LIMIT[$part]} s; its whole log:"; cat "$out/$part.log"
        elif [ "$rc" -ne 0 ]; then
            echo "!! $part FAILED (exit $rc); its whole log:"; cat "$out/$part.log"
        else
            tail -n 3 "$out/$part.log"
        fi
    done
}

stage_peers() {
    # The image has neither colossalai nor fbgemm_gpu and no network: wheels travel in a carried folder and are
    # installed into a target folder on PYTHONPATH. A wheel split into NAME.whl.part-NN (larger than one call
    # carries) is joined first. A peer still missing reports why in the JSON; the others run.
    local site=/tmp/peer_site dir first wheels=()
    local -a dirs
    IFS=: read -ra dirs <<< "${PEER_WHEELS:-.whl}"
    for dir in "${dirs[@]}"; do
        [ -d "$dir" ] || continue
        for first in "$dir"/*.whl.part-00; do
            [ -e "$first" ] && cat "${first%.part-00}".part-* > "${first%.part-00}"
        done
        for first in "$dir"/*.whl; do
            [ -e "$first" ] && wheels+=("$first")
        done
    done
    if [ ${#wheels[@]} -gt 0 ]; then
        if timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$site" "${wheels[@]}" >"$out/peers_install.log" 2>&1; then
            export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        else
            echo "peer wheels did not install (see peers_install.log):"; tail -n 5 "$out/peers_install.log"
        fi
    else
        echo "no peer wheels in ${PEER_WHEELS:-.whl}: colossalai / fbgemm_gpu peers will report 'not installed'"
    fi
    timeout 420 python3 scripts/bench_peers.py --machine "$(sed -n 2p "$out/device.txt")" \
        --out "$out/peers.json" 2>&1 | tail -n 12
}

if [ $# -eq 0 ]; then
    usage
    exit 0
fi
dry_run=0
todo=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        all) todo+=("${STAGES[@]}") ;;
        tests|kernels|step|peers|quick) todo+=("$arg") ;;
        *) echo "unknown stage '$arg': expected one of ${STAGES[*]}, quick or all" >&2; usage >&2; exit 2 ;;
    esac
done
if [ "$dry_run" -eq 1 ]; then
    out="${OUT:-$root/benchmarks/results/gpu}"
    total=0
    for stage in "${todo[@]}"; do
        echo "== stage $stage"
        if [ "$stage" = quick ]; then
            for part in "${QUICK_PARTS[@]}"; do
                echo "  $part (timeout ${QUICK_LIMIT[$part]} s): $(quick_command "$part")"
                total=$((total + QUICK_LIMIT[$part]))
            done
            echo "  parts' limits: $total s, plus the install"
        else
            declare -f "stage_$stage" | sed -n 's/^ *\(timeout .*\)/  \1/p'
        fi
    done
    exit 0
fi
setup
for stage in "${todo[@]}"; do
    echo "== stage $stage"
    "stage_$stage"
done
echo "results in $out"; ls -la "$out"
