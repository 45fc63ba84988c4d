"""CPU step time of a dynamic-id table vs a plain cached table on the same batches, and IdIndex lookups/s.

The plain table sees dense ids in [0, rows); the dynamic one sees the same ids scrambled to raw 64-bit values
(mix64), with capacity = rows, so both hold the same rows behind the same cache (the dynamic slab has
in_flight_rows spare rows more). The two step alternately on each batch; medians of wall time, and of the
process's CPU time (at --threads 1 that is the step's own work, unaffected by other processes' load on a shared
machine; with more threads it includes the pool's spinning). JSON out (benchmarks/results)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

import cachedemb
from cachedemb.dynamic.embedding_bag import DynamicIds, IdIndex, mix64


def one_step(module, ids, offsets) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one forward + backward (the fused optimizer's update)."""
    start, cpu = time.perf_counter(), time.process_time()
    module(ids, offsets).sum().backward()
    return time.perf_counter() - start, time.process_time() - cpu


def interleaved_step_seconds(plain, dyn, dense, offsets, warmup):
    """Median step times, the two modules stepping alternately on the same batch: on a shared, loaded machine
    both see the same load, so the ratio is steadier than from two back-to-back runs."""
    t_plain, t_dyn = [], []  # (wall, cpu) per step
    for i, d in enumerate(dense):
        a, b = one_step(plain, d, offsets), one_step(dyn, mix64(d), offsets)
        if i >= warmup:
            t_plain.append(a)
            t_dyn.append(b)
    return t_plain, t_dyn


def median(times, which):
    return statistics.median(t[which] for t in times)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--bag", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--out", default="benchmarks/results/dynamic_cpu.json")
    p.add_argument("--note", default="", help="the machine, in words (saved in the JSON)")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    zipf = 1.0 / torch.arange(1, args.rows + 1, dtype=torch.float64) ** 1.05
    n = args.batch * args.bag
    dense = [torch.multinomial(zipf, n, replacement=True) for _ in range(args.steps)]
    offsets = torch.arange(0, n, args.bag)
    kw = dict(mode="sum", optimizer=cachedemb.optim.RowWiseAdagrad(lr=0.01), cache_ratio=0.1)
    plain = cachedemb.CachedEmbeddingBag(args.rows, args.dim, **kw)
    dyn = cachedemb.CachedEmbeddingBag(None, args.dim, dynamic=DynamicIds(capacity=args.rows), **kw)
    all_plain, all_dyn = interleaved_step_seconds(plain, dyn, dense, offsets, args.warmup)
    t_plain, t_dyn = median(all_plain, 0), median(all_dyn, 0)
    c_plain, c_dyn = median(all_plain, 1), median(all_dyn, 1)

    index = IdIndex(size=4 * args.rows)
    keys = mix64(torch.arange(args.rows, dtype=torch.int64))
    index.insert(keys)
    queries = mix64(dense[0])
    start = time.perf_counter()
    reps = 10
    for _ in range(reps):
        index.lookup(queries)
    lookups_per_s = reps * queries.numel() / (time.perf_counter() - start)
    result = {
        "device": "cpu", "note": args.note, "torch": torch.__version__, "machine": platform.machine(), "threads": torch.get_num_threads(),
        "rows": args.rows, "dim": args.dim, "lookups_per_batch": n, "bags": args.batch, "steps": args.steps,
        "load_average_1m": os.getloadavg()[0], "timing": "median of interleaved steps (plain, dynamic, ...)",
        "plain_step_ms": 1e3 * t_plain, "dynamic_step_ms": 1e3 * t_dyn, "ratio": t_dyn / t_plain,
        "ratio_of_sums": sum(t[0] for t in all_dyn) / sum(t[0] for t in all_plain),
        "plain_step_cpu_ms": 1e3 * c_plain, "dynamic_step_cpu_ms": 1e3 * c_dyn, "cpu_ratio": c_dyn / c_plain,
        "target_ratio": 1.3, "index_lookups_per_s": lookups_per_s, "index_max_probe": index.max_disp,
        "dynamic_stats": dyn.dynamic_stats(),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
