"""Training-step time of CachedEmbeddingBag vs nn.EmbeddingBag(sparse=True) + torch.optim.SGD, same device.

A step is forward + backward + SGD update of a batch of `batch` bags x `pooling` Zipf ids. Prints one JSON
object: per table size the median step time of each implementation, their ratio, the cache hit rate, and the
ratio of the largest table's cached step to the smallest's (per-step cost must not grow with the table).

    python scripts/bench_embedding_bag.py --rows 1000000 20000000 --out benchmarks/results/x.json
"""
from __future__ import annotations

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


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, batches, warmup, device, source=None):
    """Per-step wall times after `warmup` steps; `source` (e.g. a prefetch pipeline over `batches`) is iterated
    instead of the batches, its own work between steps counted in the step that follows."""
    times = []
    t0 = None
    for i, ids in enumerate(source if source is not None else batches):
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
        step(ids)
        if i >= warmup:
            sync(device)
            t1 = time.perf_counter()
            times.append(t1 - t0)
            t0 = t1
    return times


def bench_one(num_rows, args, device, cache_rows=None, reference=True):
    lookups = args.batch * args.pooling
    trace = zipf_trace(num_rows, lookups, args.warmup + args.steps, args.alpha, seed=0)
    batches = [torch.from_numpy(b).to(torch.int64) for b in trace]
    offsets = torch.arange(args.batch, dtype=torch.int64) * args.pooling
    result = {"num_rows": num_rows}

    # Each side builds its own table, as a user's code would (the module allocates and initializes its host
    # table itself; nn.EmbeddingBag its parameter).
    if not args.skip_cached:
        size = dict(cache_ratio=args.cache_ratio) if cache_rows is None else dict(cache_rows=cache_rows)
        cached = cachedemb.CachedEmbeddingBag(num_rows, args.dim, mode="sum", **size,
                                              optimizer=cachedemb.optim.SGD(lr=0.01), device=device,
                                              validate_inputs=args.validate)

        def cached_step(ids):
            cached(ids.to(device, non_blocking=True), offsets.to(device)).sum().backward()

        source = None
        if args.prefetch:
            source = cachedemb.prefetch(batches, [cached], depth=args.prefetch, horizon=max(args.prefetch, 16))
        t = time_steps(cached_step, batches, args.warmup, device, source)
        result["cached_step_s"] = statistics.median(t)
        stats = cached.cache_stats()
        result["cache_rows"] = cached.cache.capacity
        result["hit_rate"] = stats["hits"] / max(1, stats["unique"])
        result["unique_per_batch"] = stats["unique"] / (args.warmup + args.steps)
        result["rows_in_per_batch"] = stats["rows_in"] / (args.warmup + args.steps)  # window admissions included
        result["rows_out_per_batch"] = stats["rows_out"] / (args.warmup + args.steps)
        result["cache_seconds"] = stats["seconds"]  # the O(cache) passes each have their own entry
        del cached
        gc.collect()

    if reference and not args.skip_reference:
        ref = nn.EmbeddingBag(num_rows, args.dim, mode="sum", sparse=True, device=device)
        opt = torch.optim.SGD(ref.parameters(), lr=0.01)

        def ref_step(ids):
            opt.zero_grad()
            ref(ids.to(device, non_blocking=True), offsets.to(device)).sum().backward()
            opt.step()

        t = time_steps(ref_step, batches, args.warmup, device)
        result["reference_step_s"] = statistics.median(t)
        if "cached_step_s" in result:
            result["ratio"] = result["cached_step_s"] / result["reference_step_s"]
        del ref, opt
    gc.collect()
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 20_000_000])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--pooling", type=int, default=26)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--cache-ratio", type=float, default=0.01)
    p.add_argument("--cache-rows", type=int, nargs="+",
                   help="cache sizes in rows, each on the first --rows table (overrides --cache-ratio); the "
                        "reference runs once")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prefetch", type=int, default=0, metavar="K",
                   help="run the cached side through cachedemb.prefetch with depth K (horizon max(K, 16))")
    p.add_argument("--validate", action="store_true",
                   help="validate_inputs=True (on CUDA a host sync per step; off by default, as in production)")
    p.add_argument("--skip-reference", action="store_true")
    p.add_argument("--skip-cached", action="store_true", help="time only nn.EmbeddingBag (for whole-process A/B runs)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.cache_rows:
        runs = [bench_one(args.rows[0], args, device, c, reference=i == len(args.cache_rows) - 1)
                for i, c in enumerate(args.cache_rows)]
        for r in runs:
            r["reference_step_s"] = runs[-1].get("reference_step_s")
            if r["reference_step_s"] and "cached_step_s" in r:
                r["ratio"] = r["cached_step_s"] / r["reference_step_s"]
    else:
        runs = [bench_one(n, args, device) for n in args.rows]
    report = {
        "benchmark": "embedding_bag_step",
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_threads": torch.get_num_threads(),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
        "torch": torch.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "runs": runs,
    }
    for r in runs:
        if "cached_step_s" in r:
            r["cached_us_per_unique_id"] = 1e6 * r["cached_step_s"] / r["unique_per_batch"]
    if args.cache_rows and len(runs) > 1 and not args.skip_cached:
        steps = {r["cache_rows"]: r["cached_step_s"] for r in runs}
        if 200_000 in steps:
            report["step_over_200k_cache"] = {str(c): t / steps[200_000] for c, t in steps.items()}
    elif len(runs) > 1 and not args.skip_cached:
        # A Zipf trace over a larger table has more distinct ids per batch; the per-id figure separates that
        # from any per-step cost that grows with the table itself.
        report["largest_over_smallest_cached_step"] = runs[-1]["cached_step_s"] / runs[0]["cached_step_s"]
        report["largest_over_smallest_unique_per_batch"] = runs[-1]["unique_per_batch"] / runs[0]["unique_per_batch"]
        report["largest_over_smallest_per_unique_id"] = (runs[-1]["cached_us_per_unique_id"]
                                                         / runs[0]["cached_us_per_unique_id"])
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
