#!/usr/bin/env bash
# Download, on a machine with pip access, the wheels a GPU machine without network lacks for the peers of
# scripts/bench_peers.py, into .whl/ (git-ignored; never commit wheels). Carry `.whl` to the GPU machine and run
# `bash scripts/gpu_suite.sh peers`: that stage installs every wheel it finds into a target folder on PYTHONPATH.
#
#   bash scripts/fetch_peer_wheels.sh                 colossalai + contexttimer (1.6 MB)
#   bash scripts/fetch_peer_wheels.sh --full          + galore-torch and bitsandbytes (+43 MB): colossalai's own
#                                                     package import works (else the cache's files are loaded)
#   bash scripts/fetch_peer_wheels.sh --fbgemm DIR    also fbgemm-gpu 1.6.0, split into parts under DIR (below)
#
# Written for the lent GPU image (Python 3.12, torch 2.11 + CUDA 13; its package list: psutil, peft,
# transformers, einops, numpy there already). What it lacks, and why each wheel:
# - colossalai 0.5.0: an sdist only on PyPI, built here into a pure-Python wheel, --no-deps (its requirements
#   pin torch<=2.5.1 and would pull a CUDA 12 torch).
# - contexttimer 0.3.3 (sdist only, built here): the one package ColossalAI's cache code imports beyond torch and
#   numpy.
# - --full: galore-torch and bitsandbytes, which `import colossalai.legacy.nn...` pulls through colossalai/nn/
#   optimizer although the cache never uses them. Without them bench_peers.py loads the four files
#   CachedEmbeddingBag is made of from the installed package, unchanged, and the JSON says so.
# - FBGEMM: fbgemm-gpu 1.6.0 is the release for torch 2.11 and its PyPI wheel is a CUDA 13 build (its .so files
#   link libcudart.so.13). torchrec is not needed: bench_peers.py drives FBGEMM's TBE with
#   EmbeddingLocation.MANAGED_CACHING directly, the kernel torchrec's FUSED_UVM_CACHING builds. But the wheel
#   is 465 MB (2.5 GB unpacked), over the 64 MiB one device call carries, so it is not in .whl: --fbgemm DIR
#   downloads it and splits it into folders DIR/1, DIR/2, ... of one < 60 MiB part each
#   (fbgemm_gpu-...whl.part-NN). Getting it there takes one call per part on one warm machine (it goes back
#   after 30 s idle): each call carries DIR/k and runs `mkdir -p /tmp/peer_wheels && cp DIR/k/* /tmp/peer_wheels/`;
#   the last one runs `PEER_WHEELS=.whl:/tmp/peer_wheels bash scripts/gpu_suite.sh peers`, which joins the parts
#   and installs the wheel. Not tried yet (no GPU was lent when this was written); without it the FBGEMM peer
#   reports "not installed" in the JSON.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
full=0
fbgemm_dir=""
while [ $# -gt 0 ]; do
    case "$1" in
        --full) full=1 ;;
        --fbgemm) fbgemm_dir="${2:?--fbgemm needs a folder, e.g. .whl-fbgemm}"; shift ;;
        -h|--help) sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument '$1': expected --full, --fbgemm DIR or --help" >&2; exit 2 ;;
    esac
    shift
done

py="${PYTHON:-python3}"
# Binary wheels for the GPU machine's Python and platform, whatever this machine runs.
target=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)
mkdir -p .whl
"$py" -m pip wheel -q --no-deps -w .whl colossalai==0.5.0 contexttimer==0.3.3
if [ "$full" = 1 ]; then
    "$py" -m pip download -q --no-deps "${target[@]}" -d .whl galore-torch==1.0 bitsandbytes==0.50.2
fi
if [ -n "$fbgemm_dir" ]; then
    tmp="$(mktemp -d)"
    "$py" -m pip download -q --no-deps "${target[@]}" -d "$tmp" fbgemm-gpu==1.6.0
    wheel="$(ls "$tmp"/fbgemm_gpu-*.whl)"
    name="$(basename "$wheel")"
    rm -rf "$fbgemm_dir"
    mkdir -p "$fbgemm_dir"
    split -b 60M -d -a 2 "$wheel" "$tmp/$name.part-"
    k=0
    for part in "$tmp/$name".part-*; do
        k=$((k + 1))
        mkdir -p "$fbgemm_dir/$k"
        mv "$part" "$fbgemm_dir/$k/"
    done
    rm -rf "$tmp"
    echo "fbgemm-gpu: $k parts under $fbgemm_dir/1..$k (one device call each)"
fi
ls -l .whl
size=$(du -sm .whl | cut -f1)
echo ".whl: ${size} MiB (a device call carries 64 MiB in all, the working tree included)"
[ "$size" -lt 60 ] || echo "warning: .whl is close to or over what one call carries" >&2
