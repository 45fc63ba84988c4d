#!/usr/bin/env python
"""One process, one implementation: N training steps (forward + backward + SGD) of CachedEmbeddingBag (fused SGD)
or of nn.EmbeddingBag(sparse=True) + torch.optim.SGD on the same Zipf batches (hot ids scattered), on CPU. Prints
one JSON line: median wall and process-CPU seconds per step after the warm-up.

Run it twice, once per implementation, to compare them as whole processes with any external timer (both
build a table of the same size, so the set-up cost is alike), or read the per-step figures it prints:

    python scripts/bench_step_cpu.py --impl cached --rows 1000000 --cache-rows 10000 --threads 2
    python scripts/bench_step_cpu.py --impl nn --rows 1000000 --threads 2

`--impl pair` builds both in one process and steps them alternately on the same batches (paired blocks: a step
of one, then the same batch through the other), printing each one's medians and the median of the per-step
ratios cached/nn, which survives a shared machine's drifting load better than two separate processes:

    python scripts/bench_step_cpu.py --impl pair --rows 8000000 --cache-rows 200000 --threads 1 --no-permute
"""
import argparse
import json
import platform
import statistics
import time

import torch
from torch import nn

import cachedemb
from cachedemb.modules.cache_stats import flat_seconds
from cachedemb.tools.traces import zipf_trace


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["cached", "nn", "pair"], required=True)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--cache-rows", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--pooling", type=int, default=26)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-permute", action="store_true",
                   help="hot ids at the low ids (scripts/bench_step_cpu_time.py's trace) instead of scattered")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    trace = zipf_trace(args.rows, args.batch * args.pooling, args.warmup + args.steps, args.alpha, seed=0,
                       permute=not args.no_permute)
    batches = [torch.from_numpy(b).to(torch.int64) for b in trace]
    offsets = torch.arange(args.batch, dtype=torch.int64) * args.pooling
    torch.manual_seed(0)
    steps = {}
    if args.impl in ("cached", "pair"):
        emb = cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", cache_rows=args.cache_rows,
                                           optimizer=cachedemb.optim.SGD(lr=0.01), device="cpu")

        def cached_step(ids):
            emb(ids, offsets).sum().backward()
        steps["cached"] = cached_step
    if args.impl in ("nn", "pair"):
        ref = nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True)
        opt = torch.optim.SGD(ref.parameters(), lr=0.01)

        def nn_step(ids):
            opt.zero_grad()
            ref(ids, offsets).sum().backward()
            opt.step()
        steps["nn"] = nn_step

    wall = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    for i, ids in enumerate(batches):
        for name, step in steps.items():
            w, c = time.perf_counter(), time.process_time()
            step(ids)
            if i >= args.warmup:
                wall[name].append(time.perf_counter() - w)
                cpu[name].append(time.process_time() - c)
    out = {"impl": args.impl, "rows": args.rows, "cache_rows": args.cache_rows if "cached" in steps else None,
           "dim": args.dim, "batch": f"{args.batch} x {args.pooling} zipf {args.alpha} "
                                    f"({'hot ids at low ids' if args.no_permute else 'hot ids scattered'})",
           "threads": args.threads, "steps": args.steps, "machine": platform.platform()}
    for name in steps:
        prefix = "" if len(steps) == 1 else f"{name}_"
        out[prefix + "median_step_wall_s"] = statistics.median(wall[name])
        out[prefix + "median_step_cpu_s"] = statistics.median(cpu[name])
    if len(steps) == 2:
        for kind, runs in (("wall", wall), ("cpu", cpu)):
            ratios = sorted(a / b for a, b in zip(runs["cached"], runs["nn"]))
            out[f"cached_over_nn_{kind}"] = {"median": statistics.median(ratios), "min": ratios[0],
                                             "max": ratios[-1]}
    if "cached" in steps:
        st = emb.cache_stats()
        out.update(hit_rate=st["hits"] / max(1, st["unique"]), host_rows=st["host_rows"],
                   seconds={k: round(v, 3) for k, v in flat_seconds(st["seconds"]).items()})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
