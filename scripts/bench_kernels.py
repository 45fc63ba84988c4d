"""Per-kernel timing of the cache hot path: median time, effective GB/s and, on CUDA, the fraction of the device's
memory bandwidth (host->device copies: of a measured pinned-host->device memcpy).

Sizes: a cache of 1% of a 33.7M x 128 table, a batch of 16384 bags x 26 Zipf lookups. On CUDA each op runs its
Triton path (its torch reference is timed beside it); without CUDA the references run on CPU at reduced sizes
(`--small`, implied). Bytes are the op's minimal traffic (each input read once, each output written once); the time
includes the launcher (sorts, index setup). Prints one JSON object per op. `full_ranking_gate_closed` (CUDA) times
the victim pool's gated full ranking with its flag off: what a batch the pool serves pays for it (no traffic).

    python scripts/bench_kernels.py --out benchmarks/results/kernels_h100.json
    python scripts/bench_kernels.py --small

`--aot` instead compiles, without a GPU, every kernel variant a representative workload launches (recorded on
the GPU where there is one, else on CPU under the Triton interpreter; see cachedemb/tools/aot.py) for each `--archs`
target, and reports per variant and arch its registers, shared memory, stack/local bytes (spills) and the PTX
global loads/stores, vector ones (v2/v4) counted apart:

    python scripts/bench_kernels.py --aot --out benchmarks/results/kernels_aot_sm90_sm80.json
    python scripts/bench_kernels.py --aot --variants kernels_aot_h100.json   # compile a GPU's recording here

`--row-move` (CUDA) times an admission's row moves alone (scripts/row_move_bench.py): in, out and both, 256 B and
512 B rows, host tables registered with cudaHostRegister (the library's) or from cudaHostAlloc (torch's
pin_memory), each row-move variant against the copy engine's cudaMemcpyAsync of the same bytes, plus the constants
scripts/gpu_model.py reads (pinned and pageable copy rates, launch costs). Without CUDA it refuses, unless
`--smoke` (a tiny run under TRITON_INTERPRET=1 that checks every variant against the reference; no rates).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time

import torch

from cachedemb import kernels
from cachedemb.cache.policy import SlotView, lfu

# sibling scripts (scripts/ is sys.path[0] when this runs): the row-move benchmark, and the timer both benchmarks use
import row_move_bench
from row_move_bench import Timer

# Peak HBM bandwidth by device-name fragment (first match).
PEAK_BW = (("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H200", 4.8e12), ("A100", 2.0e12))
# Issue #12's targets for the Triton paths, as fractions of peak HBM bandwidth.
TARGET_FRACTION = {"pooled_forward": 0.60, "backward_update": 0.25}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="reduced sizes (implied without CUDA)")
    p.add_argument("--out", help="also write the results as a JSON file")
    p.add_argument("--table-rows", type=int, default=33_700_000)
    p.add_argument("--cache-ratio", type=float, default=0.01)
    p.add_argument("--host-rows", type=int, default=4_000_000,
                   help="rows of the pinned host table the host->device copies read (CUDA only)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--bags", type=int, default=16384)
    p.add_argument("--pooling", type=int, default=26)
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--copy-rows", type=int, default=32768, help="rows per row_copy call")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--aot", action="store_true", help="compile the recorded kernel variants for --archs instead")
    p.add_argument("--archs", type=int, nargs="+", default=[90, 80], help="--aot: compute capabilities")
    p.add_argument("--aot-dims", type=int, nargs="*", default=[128],
                   help="--aot: besides the workload tests/test_aot_compile.py records (dims 7 and 129), one "
                        "more for each dim given (128: rows load as vectors)")
    p.add_argument("--jobs", type=int, default=2, help="--aot: compile processes")
    p.add_argument("--variants", help="--aot: compile the variants of an earlier --aot output (e.g. one recorded "
                                      "on a GPU) instead of recording here")
    p.add_argument("--row-move", action="store_true", help="the row-move microbenchmark instead (CUDA, or --smoke)")
    p.add_argument("--move-rows", type=int, default=95_000, help="--row-move: rows moved each way per call")
    p.add_argument("--smoke", action="store_true", help="--row-move without CUDA: a tiny interpreter run, no rates")
    args = p.parse_args(argv)
    if args.row_move:
        if not torch.cuda.is_available() and not args.smoke:
            p.error("--row-move times host<->GPU row moves: it needs a CUDA device (or --smoke, a tiny check of "
                    "the variants under TRITON_INTERPRET=1)")
        if args.smoke and os.environ.get("TRITON_INTERPRET", "0") != "1" and not torch.cuda.is_available():
            p.error("--row-move --smoke runs the Triton kernels on CPU: set TRITON_INTERPRET=1")
        return args
    if args.aot:
        return args
    if not torch.cuda.is_available() and not args.small:
        print("bench_kernels: no CUDA, running the CPU references at --small sizes", file=sys.stderr)
        args.small = True
    if args.small:
        args.table_rows, args.bags, args.host_rows = 1_000_000, 512, 200_000
        args.copy_rows, args.reps = 2048, 5
    return args


def zipf_ids(n, num_rows, alpha, gen, device):
    """n Zipf(alpha) ids over num_rows (inverse-CDF of the continuous law), ranks scattered by a bijection."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    if abs(alpha - 1.0) < 1e-9:
        rank = torch.exp(u * torch.log(torch.tensor(float(num_rows))))
    else:
        a = 1.0 - alpha
        rank = ((num_rows**a - 1.0) * u + 1.0).pow(1.0 / a)
    rank = rank.floor().to(torch.int64).clamp_(0, num_rows - 1)
    return (rank * 2_654_435_761 % num_rows).to(device)  # prime multiplier: a permutation of [0, num_rows)


def pinned_h2d_bandwidth(timer, nbytes=256 << 20):
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=timer.device)
    return nbytes / timer.median_s(lambda: dev.copy_(host, non_blocking=True))


def lazy(module, name):
    """`cachedemb.kernels.<module>.<name>`, or None while it is not written yet."""
    try:
        return getattr(importlib.import_module(f"cachedemb.kernels.{module}"), name, None)
    except ImportError:
        return None


def build(args, device):
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    capacity = max(1, int(args.cache_ratio * args.table_rows))
    n_lookups = args.bags * args.pooling
    ids = zipf_ids(n_lookups, args.table_rows, args.alpha, gen, device)
    uniq, inverse, counts, n_uniq = kernels.unique_ids_torch(ids)
    n = int(n_uniq)  # setup may sync
    loc_u = torch.full((n_lookups,), -1, dtype=torch.int64)
    loc_u[:n] = torch.randperm(capacity, generator=gen)[:n] if n <= capacity else torch.arange(n) % capacity
    resident = torch.randperm(args.table_rows, generator=gen)[:capacity].sort().values
    return dict(
        dtype=dtype, capacity=capacity, n_lookups=n_lookups, n=n, ids=ids, uniq=uniq, inverse=inverse,
        n_uniq=n_uniq, loc_u=loc_u.to(device),
        offsets=(torch.arange(args.bags + 1, dtype=torch.int64) * args.pooling).to(device),
        rows=torch.randn(capacity, args.dim, generator=gen).to(device=device, dtype=dtype),
        grad_out=torch.randn(args.bags, args.dim, generator=gen).to(device),
        keys=resident.to(device), slots=torch.randperm(capacity, generator=gen).to(device),
        score=((torch.randint(0, 1 << 40, (capacity,), generator=gen) << 20)
               | torch.arange(capacity)).to(device),
    )


def ops(args, b, device):
    """(name, {impl: callable}, bytes moved, bandwidth reference) per op."""
    cuda = device.type == "cuda"
    B, D, e, n = b["n_lookups"], args.dim, b["rows"].element_size(), b["n"]
    bags = args.bags
    rule = kernels.UpdateRule(kernels.ADAGRAD, lr=0.01, eps=1e-10)
    states = [torch.zeros(b["capacity"], D, device=device)]

    def pair(module, name, ref, call):
        impls = {"torch": lambda: call(ref)}
        fast = lazy(module, f"{name}_triton") if cuda else None
        if fast is not None:
            impls["triton"] = lambda: call(fast)
        elif cuda:
            impls["skipped"] = f"no {name}_triton in kernels/{module}.py"
        return impls

    fwd = lambda f: f(b["rows"], b["loc_u"], b["inverse"], b["offsets"], kernels.MODE_SUM, None)
    yield ("pooled_forward", pair("pooled_forward", "pooled_forward", kernels.pooled_forward_torch, fwd),
           B * (8 + 8 + D * e) + bags * D * e + (bags + 1) * 8, "hbm")

    upd = lambda f: f(b["rows"], states, b["loc_u"], b["n_uniq"], b["grad_out"], b["inverse"], b["offsets"],
                      kernels.MODE_SUM, None, None, rule)
    # grad_out gathered per lookup + the lookup's sort/bag/scale, rows and the Adagrad state read and written
    yield ("backward_update", pair("sparse_update", "backward_update", kernels.backward_update_torch, upd),
           B * (D * 4 + 8 + 8 + 8 + 4) + n * (8 + 8 + 2 * D * e + 2 * D * 4), "hbm")

    yield ("unique_ids", pair("unique_ids", "unique_ids", kernels.unique_ids_torch, lambda f: f(b["ids"])),
           B * 8 + 3 * B * 8 + 8, "hbm")

    look = lambda f: f(b["keys"], b["slots"], b["uniq"], b["n_uniq"])
    yield ("slot_lookup", pair("slot_lookup", "slot_lookup", kernels.slot_lookup_torch, look),
           B * (8 + 8) + n * (8 + 8), "hbm")

    k = min(args.copy_rows, b["capacity"])
    yield ("victim_select", pair("victim_select", "victim_select", kernels.victim_select_torch,
                                 lambda f: f(b["score"], k)), b["capacity"] * 8 + k * 8, "hbm")

    # the full ranking's scoring of every slot (lfu), and its cost when the victim pool's gate is closed: what a
    # batch the pool serves pays for the ranking under the CUDA rules (a few idle persistent launches)
    C = b["capacity"]
    g1 = torch.Generator().manual_seed(2)
    slot_meta = [torch.randint(-1, args.table_rows, (C,), generator=g1), torch.randint(0, 1000, (C,), generator=g1),
                 torch.randint(0, 1000, (C,), generator=g1), torch.full((C,), -1, dtype=torch.int64)]
    slot_meta = [t.to(device) for t in slot_meta] + [torch.zeros(C, dtype=torch.bool, device=device)]
    impls = {"torch": lambda: lfu(SlotView(*slot_meta))}
    if cuda:
        impls["triton"] = lambda: kernels.slot_score_triton(kernels.SCORE_LFU, *slot_meta)
    yield "slot_score", impls, C * (4 * 8 + 1 + 8), "hbm"
    if cuda:
        closed = torch.zeros(1, dtype=torch.bool, device=device)

        def gated_ranking():
            score = kernels.slot_score_triton(kernels.SCORE_LFU, *slot_meta, gate=closed)
            kernels.victim_select(score, k, gate=closed)

        yield "full_ranking_gate_closed", {"triton": gated_ranking}, 0, "idle"

    gen = torch.Generator().manual_seed(1)
    host_rows = min(args.host_rows, args.table_rows)
    host = torch.empty(host_rows, D, dtype=b["dtype"], pin_memory=cuda)
    host.copy_(torch.randn(host_rows, D, generator=gen))
    m = min(args.copy_rows, b["capacity"], host_rows)
    src_idx = torch.randperm(host_rows, generator=gen)[:m].to(device)
    dst_idx = torch.randperm(b["capacity"], generator=gen)[:m].to(device)
    count = torch.tensor([m], device=device)
    copy_bytes = m * (2 * D * e + 16)
    copy = lambda f: f(host, src_idx, b["rows"], dst_idx, count)
    impls = {"torch": lambda: copy(kernels.row_copy_torch)}
    if cuda:
        fast = lazy("row_copy", "row_copy_triton")
        if fast is None:
            impls["skipped"] = "no row_copy_triton in kernels/row_copy.py"
        else:
            os.environ["CACHEDEMB_ROW_COPY"] = "zero_copy"  # row_copy_triton's mode, read at call time
            impls["triton"] = lambda: copy(fast)
    yield "row_copy_h2d_zero_copy", impls, copy_bytes, "h2d"
    if cuda:
        staged = lazy("row_copy", "row_copy_staged")
        impls = {"staged": lambda: copy(staged)} if staged is not None else {
            "skipped": "no row_copy_staged in kernels/row_copy.py"}
        yield "row_copy_h2d_staged", impls, copy_bytes, "h2d"


def run(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timer = Timer(device.type == "cuda", args.reps)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "small": args.small, "table_rows": args.table_rows,
            "cache_rows": int(args.cache_ratio * args.table_rows), "dim": args.dim, "dtype": args.dtype,
            "bags": args.bags, "pooling": args.pooling, "alpha": args.alpha}
    peak = {"hbm": None, "h2d": None, "idle": None}  # idle: timed only (no traffic to rate)
    if device.type == "cuda":
        name = meta["device"]
        peak["hbm"] = next((bw for frag, bw in PEAK_BW if frag in name), None)
        peak["h2d"] = pinned_h2d_bandwidth(timer)
        meta["peak_hbm_GBps"] = peak["hbm"] and peak["hbm"] / 1e9
        meta["pinned_h2d_memcpy_GBps"] = peak["h2d"] / 1e9
    b = build(args, device)
    meta["n_lookups"], meta["n_uniq"] = b["n_lookups"], b["n"]
    print(json.dumps({"meta": meta}), flush=True)
    results = []
    for name, impls, nbytes, ref in ops(args, b, device):
        for impl, fn in impls.items():
            row = {"op": name, "impl": impl, "bytes": nbytes}
            if impl == "skipped":
                row["skipped"] = fn
            else:
                t = timer.median_s(fn)
                row.update(median_ms=t * 1e3, GBps=nbytes / t / 1e9)
                if peak[ref]:
                    row[f"fraction_of_{ref}"] = nbytes / t / peak[ref]
                    if name in TARGET_FRACTION and impl != "torch":
                        row["target_fraction"] = TARGET_FRACTION[name]
                        row["meets_target"] = row[f"fraction_of_{ref}"] >= TARGET_FRACTION[name]
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return results


AOT_FIELDS = ("registers", "shared_bytes", "stack_bytes", "local_bytes", "spill_store_bytes", "spill_load_bytes",
              "spills", "ld_global", "ld_global_v2", "ld_global_v4", "st_global", "st_global_v2", "st_global_v4",
              "error")


def git_version() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_aot(args):
    import triton
    from triton import knobs

    from cachedemb.tools import aot

    missing = aot.toolchain_missing()
    if missing:
        raise SystemExit(f"bench_kernels --aot: {missing}")
    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    if args.variants:
        with open(args.variants) as f:
            earlier = json.load(f)
        variants = [aot.KernelVariant.from_json(v) for v in earlier["variants"]]
        em = earlier["meta"]
        recorded = {"recorded_on": em["recorded_on"], "workloads": em["workloads"],
                    "recorded_with": f"torch {em['torch']}, triton {em['triton']}, git {em['git']}"}
    else:
        workloads = [{"dims": list(aot.WORKLOAD_DIMS), "steps": 2}] + [{"dims": [d], "steps": 2} for d in args.aot_dims]
        variants = list(dict.fromkeys(v for w in workloads for v in aot.record_library_launches(**w)))
        recorded = {"recorded_on": torch.cuda.get_device_name() if cuda else "cpu (TRITON_INTERPRET=1)",
                    "workloads": workloads}
    t1 = time.perf_counter()
    rows = aot.compile_variants(variants, args.archs, jobs=args.jobs)
    t2 = time.perf_counter()
    meta = {**recorded, "compiled_on": f"{platform.machine()}, {os.cpu_count()} cpus, "
                                       f"{'CUDA' if cuda else 'no GPU'}",
            "git": git_version(), "torch": torch.__version__, "triton": triton.__version__,
            "ptxas": knobs.nvidia.ptxas.version, "archs": [f"sm_{a}" for a in args.archs],
            "variants": len(variants), "record_s": round(t1 - t0, 1), "compile_s": round(t2 - t1, 1)}
    print(json.dumps({"meta": meta}), flush=True)
    results = []
    for r in rows:
        row = {"kernel": r["kernel"], "arch": r["arch"], "label": r["label"],
               "constexprs": r["variant"]["constexprs"], "options": r["variant"]["options"]}
        row.update({k: r[k] for k in AOT_FIELDS if k in r})
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:  # one result / variant a line: diffs stay readable
            lines = lambda items: ",\n  ".join(json.dumps(x) for x in items)
            f.write(f'{{"meta": {json.dumps(meta)},\n "results": [\n  {lines(results)}],\n '
                    f'"variants": [\n  {lines(v.to_json() for v in variants)}]}}\n')
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.row_move:
        return row_move_bench.run(args)
    if args.aot:
        run_aot(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
