#!/usr/bin/env python
"""Per-step process CPU time (1 torch thread) of CachedEmbeddingBag + fused SGD at several cache sizes and of
nn.EmbeddingBag(sparse) + torch SGD: on a shared box, CPU time is less disturbed by other processes than wall time.

The default trace (14 batches of 4096 x 26 Zipf ids, 8 warm-up) fills a 200k-row cache during the warm-up, so the
timed steps of small caches evict and write back every batch (the steady state), while a 4M-row cache still
admits without evicting: the comparison issue #12 asks for (per-batch cost follows the batch, not the cache).

    OMP_NUM_THREADS=1 python scripts/bench_step_cpu_time.py --rows 20000000 --cache-rows 50000 200000 1000000 4000000 \
        --out benchmarks/results/x.json
"""
import argparse
import gc
import json
import platform
import statistics
import time

import torch
from torch import nn

import cachedemb
from cachedemb.tools.traces import zipf_trace


def median_step(fn, batches, warmup):
    times = []
    for i, b in enumerate(batches):
        t = time.process_time()
        fn(b)
        if i >= warmup:
            times.append(time.process_time() - t)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8_000_000)
    p.add_argument("--cache-rows", type=int, nargs="+", default=[200_000, 4_000_000])
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    trace = zipf_trace(args.rows, 4096 * 26, args.warmup + args.steps, 1.05, seed=0)
    batches = [torch.from_numpy(b).to(torch.int64) for b in trace]
    off = torch.arange(4096) * 26
    out = {"num_rows": args.rows, "dim": 64, "batch": "4096 x 26 zipf 1.05", "warmup": args.warmup,
           "steps": args.steps, "torch_threads": 1, "machine": platform.platform(), "runs": []}
    for c in args.cache_rows:
        emb = cachedemb.CachedEmbeddingBag(args.rows, 64, mode="sum", cache_rows=c,
                                           optimizer=cachedemb.optim.SGD(lr=0.01), device="cpu")
        s = median_step(lambda b: emb(b, off).sum().backward(), batches, args.warmup)
        st = emb.cache_stats()
        out["runs"].append({"cache_rows": c, "cached_step_cpu_s": s, "hit_rate": st["hits"] / st["unique"],
                            "evictions": st["evictions"], "seconds": st["seconds"]})
        print(out["runs"][-1], flush=True)
        del emb
        gc.collect()
    ref = nn.EmbeddingBag(args.rows, 64, mode="sum", sparse=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.01)

    def ref_step(b):
        opt.zero_grad()
        ref(b, off).sum().backward()
        opt.step()

    out["reference_step_cpu_s"] = median_step(ref_step, batches, args.warmup)
    for r in out["runs"]:
        r["over_reference"] = r["cached_step_cpu_s"] / out["reference_step_cpu_s"]
    by_rows = {r["cache_rows"]: r["cached_step_cpu_s"] for r in out["runs"]}
    if 200_000 in by_rows and 4_000_000 in by_rows:
        out["cache_4M_over_200k"] = by_rows[4_000_000] / by_rows[200_000]
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
