#!/usr/bin/env python
"""Each C helper's own gain: the workload it speeds up, timed with that one helper on and off.

The C helpers (kernels/native.py) each replace a torch / numpy / Python path that stays their reference. A
helper is worth its C only where switching it off alone slows the step it serves. Three workloads, the shapes
of scripts/bench_step_cpu.py, bench_prefetch.py and bench_storage.py at small sizes (Zipf(1.05) batches of
4096 x 26 ids, hot ids scattered, dim 64, fused SGD, one torch thread, CPU):

  step      CachedEmbeddingBag training steps       place_native, pool_native, host_rows, host_sgd
  prefetch  the same through cachedemb.prefetch     host_map, pool_native, place_native
  storage   a table on disk (FileStorage, host       row_index, slab_victims, record_copy, rowio
            cache 1/16 of it) through prefetch
  micro     one call of slab_victims at the table's sizes (its share of a small table's step is in the noise)

benchmarks/results/native_helpers_cpu.json also has the helpers measured and dropped (host_sort, score_native,
inner_unique: their C is gone, their pure paths remain).

Per workload, after a warm-up, rounds of two blocks of steps, one with the helper on and one with it off
(`helper.NATIVE.enabled`, as the tests switch it; the order alternates round by round), each block's time per
step in process CPU seconds (all threads: the read-ahead's and the I/O threads' too; on a shared machine far
steadier than wall time, also printed) and wall seconds (storage: its file I/O drained inside the block).
Printed as JSON: per helper the medians and the median of the rounds' off/on ratios (`gain`: CPU's, - 1).
Whole processes can be compared the same way with CACHEDEMB_NATIVE_DISABLE=<helper>.

    python scripts/bench_native.py --out benchmarks/results/native_helpers_cpu.json --machine "..."
    python scripts/bench_native.py --workloads step --helpers host_sort --rounds 2   # a quick look
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import cachedemb
from cachedemb.kernels import native
from cachedemb.tools.traces import zipf_trace

MODULES = {"host_map": "cachedemb.prefetch.host_map", "host_rows": "cachedemb.kernels.host_rows",
           "host_sgd": "cachedemb.kernels.host_sgd", "place_native": "cachedemb.cache.place_native",
           "pool_native": "cachedemb.cache.pool_native", "record_copy": "cachedemb.storage.record_copy",
           "row_index": "cachedemb.storage.row_index", "rowio": "cachedemb.storage.rowio",
           "slab_victims": "cachedemb.storage.slab_victims"}
MICRO = ["slab_victims"]
WORKLOADS = {
    "step": ["place_native", "pool_native", "host_rows", "host_sgd"],
    "prefetch": ["host_map", "pool_native", "place_native"],
    "storage": ["row_index", "slab_victims", "record_copy", "rowio"],
}


def helper(name: str):
    return importlib.import_module(MODULES[name]).NATIVE


class Stepper:
    """One workload's module and batch source; `block(k)` runs k training steps and returns seconds per step."""

    def __init__(self, kind: str, args, work: Path):
        self.kind = kind
        n_batches = args.warmup + 2 * args.rounds * args.block * (len(WORKLOADS[kind]) + 1) + 64
        trace = zipf_trace(args.rows, 4096 * 26, n_batches, 1.05, seed=0)
        batches = [torch.from_numpy(b).to(torch.int64) for b in trace]
        self.offsets = torch.arange(4096) * 26
        spec = cachedemb.optim.SGD(lr=0.01)
        torch.manual_seed(0)
        storage = None
        if kind == "storage":
            path = work / "table.cemb"
            creator = cachedemb.CachedEmbeddingBag(args.rows, 64, mode="sum", cache_rows=args.rows // 100,
                                                   optimizer=spec, device="cpu",
                                                   storage=cachedemb.FileStorage(path, host_cache_bytes=16 << 20))
            table_bytes = creator.table.header.num_rows * creator.table.record
            creator.close()
            os.sync()
            storage = cachedemb.FileStorage(path, host_cache_bytes=table_bytes // 16)
        cache_rows = args.rows // 100 if kind == "storage" else args.cache_rows
        self.emb = cachedemb.CachedEmbeddingBag(args.rows, 64, mode="sum", cache_rows=cache_rows, optimizer=spec,
                                                device="cpu", storage=storage)
        if kind == "step":
            self.source = iter(batches)
        else:
            self.source = iter(cachedemb.prefetch(batches, [self.emb], depth=args.depth, horizon=args.horizon))
        self.block(args.warmup)

    def block(self, k: int) -> tuple[float, float]:
        """(process CPU seconds, wall seconds) per step over k steps."""
        t, c = time.perf_counter(), time.process_time()
        for _ in range(k):
            self.emb(next(self.source), self.offsets).sum().backward()
        if self.kind == "storage":
            self.emb.host.fence()
            self.emb.table.drain()
        return (time.process_time() - c) / max(k, 1), (time.perf_counter() - t) / max(k, 1)

    def close(self):
        if self.kind == "storage":
            self.emb.close()


def measure(stepper: Stepper, names: list[str], rounds: int, block: int) -> dict:
    """Blocks with `names` switched off against blocks with every helper on, alternating which goes first."""
    switches = [helper(n) for n in names]
    runs = {(state, kind): [] for state in (True, False) for kind in ("cpu", "wall")}
    for r in range(rounds):
        for state in ((True, False) if r % 2 == 0 else (False, True)):
            for s in switches:
                s.enabled = state
            cpu, wall = stepper.block(block)
            runs[state, "cpu"].append(cpu), runs[state, "wall"].append(wall)
        for s in switches:
            s.enabled = True
    out = {}
    for kind in ("cpu", "wall"):
        ratios = [b / a for a, b in zip(runs[True, kind], runs[False, kind])]
        out[kind] = {"on_ms": round(1e3 * statistics.median(runs[True, kind]), 2),
                     "off_ms": round(1e3 * statistics.median(runs[False, kind]), 2),
                     "off_over_on": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios]}
    out["gain"] = round(out["cpu"]["off_over_on"] - 1, 3)
    return out


def micro_calls(rows: int) -> dict:
    """One wrapper call each at a `rows`-row table's sizes (a 1/16 host cache's slab): where a workload's step is
    too noisy to show a helper's share, its call on and off (the wrapper's own pure path)."""
    import numpy as np

    from cachedemb.storage import slab_victims

    rng = np.random.default_rng(0)
    slab = rows // 16  # a 1/16 host cache's rows
    row_id = rng.permutation(rows)[:slab].astype(np.int64)
    row_id[rng.random(slab) < 0.02] = -1
    row_step = rng.integers(0, 100, slab).astype(np.int64)
    next_use = rng.integers(-1, 120, slab).astype(np.int64)
    freq = rng.integers(0, 1000, slab).astype(np.int64)
    keep = rng.choice(slab, 4096, replace=False).astype(np.int64)
    return {"slab_victims": lambda: slab_victims.victim_keys(row_id, row_step, next_use, freq, 95, keep)}


def measure_call(name: str, call, reps: int) -> dict:
    switch = helper(name)
    runs = {True: [], False: []}
    for r in range(reps):
        for state in ((True, False) if r % 2 == 0 else (False, True)):
            switch.enabled = state
            c = time.process_time()
            call()
            runs[state].append(time.process_time() - c)
    switch.enabled = True
    on, off = statistics.median(runs[True]), statistics.median(runs[False])
    return {"call_on_ms": round(1e3 * on, 3), "call_off_ms": round(1e3 * off, 3), "off_over_on": round(off / on, 3)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--cache-rows", type=int, default=20_000, help="step and prefetch workloads' cache")
    p.add_argument("--depth", type=int, default=2, help="prefetch and storage workloads' cachedemb.prefetch depth")
    p.add_argument("--horizon", type=int, default=16, help="... and horizon")
    p.add_argument("--warmup", type=int, default=20, help="steps before timing (the caches fill)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block", type=int, default=6, help="steps per timed block")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS) + ["micro"], default=list(WORKLOADS),
                   help="micro: one call of slab_victims at the table's sizes (on vs off)")
    p.add_argument("--helpers", nargs="+", choices=native.NAMES, help="only these helpers (default: all)")
    p.add_argument("--machine", default="", help="a note on the machine and its load, kept in the JSON")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the storage workload's table file goes")
    p.add_argument("--out")
    args = p.parse_args()
    if not native.native_available():
        raise SystemExit(f"the C helpers are not available ({native.status()}): nothing to compare")
    if args.rounds < 1 or args.block < 1 or args.rows < 10_000:
        raise SystemExit(f"need --rounds >= 1, --block >= 1, --rows >= 10000; got {args.rounds}, {args.block}, "
                         f"{args.rows}")
    torch.set_num_threads(1)
    root = Path(__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    out = {"what": "each C helper on vs off (alone) in the workload it speeds up: scripts/bench_native.py",
           "commit": commit, "machine": args.machine, "platform": platform.platform(), "cores": os.cpu_count(),
           "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "rows": args.rows, "dim": 64,
           "batch": "4096 x 26 zipf 1.05 (scattered)", "torch_threads": 1, "cache_rows": args.cache_rows,
           "prefetch": {"depth": args.depth, "horizon": args.horizon},
           "warmup": args.warmup, "rounds": args.rounds, "block": args.block, "workloads": {}}
    work = Path(tempfile.mkdtemp(prefix="cachedemb-bench-native-", dir=args.dir))
    t0 = time.perf_counter()
    try:
        if "micro" in args.workloads:
            calls = micro_calls(args.rows)
            out["micro"] = {n: measure_call(n, calls[n], 4 * args.rounds + 1) for n in MICRO
                            if args.helpers is None or n in args.helpers}
            print(json.dumps({"micro": out["micro"]}), flush=True)
        for kind in (k for k in args.workloads if k != "micro"):
            names = [n for n in WORKLOADS[kind] if args.helpers is None or n in args.helpers]
            if not names:
                continue
            stepper = Stepper(kind, args, work)
            result = {}
            if args.helpers is None:  # every helper of the workload off at once, for scale
                result["all_off"] = measure(stepper, WORKLOADS[kind], args.rounds, args.block)
                print(json.dumps({kind: {"all_off": result["all_off"]}}), flush=True)
            for name in names:
                result[name] = measure(stepper, [name], args.rounds, args.block)
                print(json.dumps({kind: {name: result[name]}}), flush=True)
            stepper.close()
            out["workloads"][kind] = result
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
