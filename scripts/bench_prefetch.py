#!/usr/bin/env python
"""Training-step time with and without cachedemb.prefetch, CPU: does the look-ahead pay for itself?

One CachedEmbeddingBag (default 8M rows x 64, fused SGD, 1 torch thread) trained on Zipf(1.05) batches of
4096 x 26 ids with the hot ids scattered over the table, at each cache ratio: once without prefetch, then through
`cachedemb.prefetch(batches, [emb], depth=K, horizon=H)` for every K and H. Each run starts from a fresh module,
fills the cache during `--warmup` batches, then times `--batches` steps: wall time per step, the training thread's
CPU time and the process's (the read-ahead thread included). Also per run: rows moved host->device, hit rate
(1 - rows moved / distinct ids looked up, so runs with and without windows compare), window sizes, and the host
milliseconds per batch of every cache and pipeline stage (`cache_stats()["seconds"]`). Prints JSON; `--out` writes
it.

    python scripts/bench_prefetch.py --trace-cache /tmp/zipf_trace.npy --out benchmarks/results/prefetch_cpu.json

`--one none|prefetch` runs a single configuration (`--ratio`, `--depth`, `--horizon`) and prints its record: the
form to time as a whole process, prefetch against none, e.g. with `/usr/bin/time -v` or a paired A/B timer.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time

import numpy as np
import torch

import cachedemb
from cachedemb.tools.traces import zipf_trace


def load_trace(args) -> list[torch.Tensor]:
    """The batches' ids (flat, 4096 x 26 each), generated once and kept in `--trace-cache` if given."""
    count = args.warmup + args.batches
    path = args.trace_cache
    if path and os.path.exists(path):
        stored = np.load(path, mmap_mode="r")
        if stored.shape[0] >= count and stored.shape[1] == args.bags * args.bag_len:
            return [torch.from_numpy(np.array(stored[i])) for i in range(count)]
    trace = np.stack(zipf_trace(args.rows, args.bags * args.bag_len, count, args.alpha, seed=args.seed))
    if path:
        np.save(path, trace)
    return [torch.from_numpy(b) for b in trace]


def run(trace: list[torch.Tensor], args, ratio: float, mode: str, depth: int = 0, horizon: int = 0) -> dict:
    torch.manual_seed(0)
    emb = cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", cache_ratio=ratio, device="cpu",
                                       optimizer=cachedemb.optim.SGD(lr=0.01))
    offsets = torch.arange(args.bags) * args.bag_len
    source = trace if mode == "none" else cachedemb.prefetch(trace, [emb], depth=depth, horizon=horizon)
    wall, thread_cpu, process_cpu = [], [], []
    start = None
    for i, ids in enumerate(source):
        if i == args.warmup:
            emb.cache.reset_stats()
            start = (time.perf_counter(), time.thread_time(), time.process_time())
        t = (time.perf_counter(), time.thread_time(), time.process_time())
        emb(ids, offsets).sum().backward()
        if i >= args.warmup:
            now = (time.perf_counter(), time.thread_time(), time.process_time())
            # a step is everything between two batches: this one's forward and backward, and the pipeline's
            # work when the loop asks for the next batch (counted in the next step)
            wall.append(now[0] - t[0])
            thread_cpu.append(now[1] - t[1])
            process_cpu.append(now[2] - t[2])
    end = (time.perf_counter(), time.thread_time(), time.process_time())
    steps = len(wall)
    stats = emb.cache_stats()
    record = {
        "mode": mode, "cache_ratio": ratio, "cache_rows": emb.cache.capacity,
        "depth": depth or None, "horizon": horizon or None, "steps": steps,
        # whole loop (pipeline included) per step: the figure to compare
        "step_ms": round(1000 * (end[0] - start[0]) / steps, 2),
        "thread_cpu_ms": round(1000 * (end[1] - start[1]) / steps, 2),
        "process_cpu_ms": round(1000 * (end[2] - start[2]) / steps, 2),
        "step_ms_median": round(1000 * statistics.median(wall), 2),
        "rows_moved": stats["rows_in"], "unique_lookups": stats["unique"],
        "hit_rate": round(1 - stats["rows_in"] / max(1, stats["unique"]), 4),
        "forward_hit_rate": round(stats["hits"] / max(1, stats["unique"]), 4),
        "windows": stats["windows"],
        "stage_ms_per_batch": {k: round(1000 * v / steps, 3) for k, v in stats["seconds"].items() if v},
    }
    if mode != "none":
        counts = source.window_batches
        record["window_batches"] = {str(k): counts.count(k) for k in sorted(set(counts))}
    del emb, source
    gc.collect()
    return record


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rows", type=int, default=8_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--bags", type=int, default=4096)
    p.add_argument("--bag-len", type=int, default=26)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.05])
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--horizons", type=int, nargs="+", default=[16, 64])
    p.add_argument("--warmup", type=int, default=40, help="batches before timing (the cache fills)")
    p.add_argument("--batches", type=int, default=60, help="timed batches")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--trace-cache", help=".npy file keeping the generated batches between runs")
    p.add_argument("--one", choices=["none", "prefetch"], help="run one configuration only")
    p.add_argument("--ratio", type=float, default=0.01, help="with --one")
    p.add_argument("--depth", type=int, default=4, help="with --one")
    p.add_argument("--horizon", type=int, default=64, help="with --one")
    p.add_argument("--machine", default="", help="a note on the machine, kept in the JSON")
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    trace = load_trace(args)
    if args.one:
        record = run(trace, args, args.ratio, args.one, args.depth, args.horizon)
        print(json.dumps(record))
        return record
    results = []
    for ratio in args.ratios:
        base = run(trace, args, ratio, "none")
        results.append(base)
        print(json.dumps(base), flush=True)
        for depth in args.depths:
            for horizon in args.horizons:
                if horizon < depth:
                    continue
                r = run(trace, args, ratio, "prefetch", depth, horizon)
                r["over_none"] = {k: round(r[k] / base[k], 3) for k in ("step_ms", "thread_cpu_ms", "process_cpu_ms")}
                r["rows_moved_over_none"] = round(r["rows_moved"] / max(1, base["rows_moved"]), 3)
                results.append(r)
                print(json.dumps(r), flush=True)
    report = {
        "benchmark": "prefetch_step_cpu",
        "machine": {"note": args.machine, "platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "one", "ratio", "depth", "horizon")},
        "runs": results,
    }
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return report


if __name__ == "__main__":
    main()
