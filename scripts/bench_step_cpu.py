#!/usr/bin/env python
"""One process, one implementation: N training steps (forward + backward + SGD) of CachedEmbeddingBag (fused SGD)
or of nn.EmbeddingBag(sparse=True) + torch.optim.SGD on the same Zipf batches (hot ids scattered), on CPU. Prints
one JSON line: median wall and process-CPU seconds per step after the warm-up.

Run it twice, once per implementation, to compare them as whole processes with any external timer (both
build a table of the same size, so the set-up cost is alike), or read the per-step figures it prints:

    python scripts/bench_step_cpu.py --impl cached --rows 1000000 --cache-rows 10000 --threads 2
    python scripts/bench_step_cpu.py --impl nn --rows 1000000 --threads 2
"""
import argparse
import json
import platform
import statistics
import time

import torch
from torch import nn

import cachedemb
from cachedemb.tools.traces import zipf_trace


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["cached", "nn"], required=True)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--cache-rows", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--pooling", type=int, default=26)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    trace = zipf_trace(args.rows, args.batch * args.pooling, args.warmup + args.steps, args.alpha, seed=0,
                       permute=True)
    batches = [torch.from_numpy(b).to(torch.int64) for b in trace]
    offsets = torch.arange(args.batch, dtype=torch.int64) * args.pooling
    torch.manual_seed(0)
    if args.impl == "cached":
        emb = cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", cache_rows=args.cache_rows,
                                           optimizer=cachedemb.optim.SGD(lr=0.01), device="cpu")

        def step(ids):
            emb(ids, offsets).sum().backward()
    else:
        emb = nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.01)

        def step(ids):
            opt.zero_grad()
            emb(ids, offsets).sum().backward()
            opt.step()

    wall, cpu = [], []
    for i, ids in enumerate(batches):
        w, c = time.perf_counter(), time.process_time()
        step(ids)
        if i >= args.warmup:
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
    out = {"impl": args.impl, "rows": args.rows, "cache_rows": args.cache_rows if args.impl == "cached" else None,
           "dim": args.dim, "batch": f"{args.batch} x {args.pooling} zipf {args.alpha} (hot ids scattered)",
           "threads": args.threads, "steps": args.steps, "median_step_wall_s": statistics.median(wall),
           "median_step_cpu_s": statistics.median(cpu), "machine": platform.platform()}
    if args.impl == "cached":
        st = emb.cache_stats()
        out.update(hit_rate=st["hits"] / max(1, st["unique"]), host_rows=st["host_rows"],
                   seconds={k: round(v, 3) for k, v in st["seconds"].items()})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
