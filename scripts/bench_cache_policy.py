"""Rows moved host->device by each cache policy on id traces, against Belady-OPT.

Policies: LRU, LFU, LFU with counts reset on admission (ColossalAI), 32-way set-associative LRU (FBGEMM) and OPT
are replayed by the offline simulators (cachedemb.tools.cache_sim); this library's own policies drive the real module
(CachedEmbeddingBag training steps): its LFU and LRU without prefetch, and `lookahead` through
cachedemb.prefetch at each horizon H and admission depth K (a window of K batches must be resident together,
so K > 1 pays for its look-ahead in cache space; K = 1 has exactly OPT's constraint). Prints JSON: per trace and cache ratio, each policy's rows moved,
hit rate (1 - rows moved / unique lookups) and rows moved / OPT's.

    python scripts/bench_cache_policy.py --out benchmarks/results/cache_policy_cpu.json
    python scripts/bench_cache_policy.py --trace-file my_ids.npy --ratios 0.01
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

import cachedemb
from cachedemb.tools import cache_sim
from cachedemb.tools.traces import criteo_like_trace, criteo_table_sizes, load_trace, table_offsets, zipf_trace


def module_run(trace, num_rows, capacity, policy, horizon=None, depth=4, table_starts=None, overlap=False):
    """Replay the trace through a real CachedEmbeddingBag (training steps, SGD lr=0 so the table is fixed);
    a multi-table trace shares one cache, as a CachedEmbeddingBagCollection group does."""
    emb = cachedemb.CachedEmbeddingBag(num_rows, 1, mode="sum", cache_rows=capacity, device="cpu",
                                       optimizer=cachedemb.optim.SGD(lr=0.0),
                                       policy=policy if horizon is None else "lfu",
                                       _weight=torch.zeros(num_rows, 1))
    if table_starts is not None:
        emb.cache.set_tables(table_starts)
    batches = [(torch.from_numpy(b), torch.zeros(1, dtype=torch.int64)) for b in trace]
    source = batches if horizon is None else cachedemb.prefetch(batches, [emb], depth=depth, horizon=horizon,
                                                                 policy=policy, overlap=overlap)
    start = time.perf_counter()
    for ids, offsets in source:
        emb(ids, offsets).sum().backward()
    stats = emb.cache_stats()
    return {"rows_moved": stats["rows_in"], "unique_lookups": stats["unique"],
            "seconds": round(time.perf_counter() - start, 3)}


def sim_run(prepared, capacity, name, **kw):
    start = time.perf_counter()
    r = cache_sim.simulate(name, prepared, capacity, **kw)
    return {"rows_moved": int(r.rows_moved), "unique_lookups": int(r.unique_lookups),
            "seconds": round(time.perf_counter() - start, 3)}


def bench_trace(name, trace, num_rows, ratios, horizons, depths, table_starts=None):
    prepared = cache_sim.prepare_trace(trace)
    out = {"trace": name, "num_rows": num_rows, "batches": len(trace),
           "lookups_per_batch": float(np.mean([len(b) for b in trace])),
           "unique_per_batch": float(np.mean([len(np.unique(b)) for b in trace])), "by_ratio": []}
    for ratio in ratios:
        capacity = max(1, int(round(ratio * num_rows)))
        rows = {
            "opt": sim_run(prepared, capacity, "opt"),
            "sim_lru": sim_run(prepared, capacity, "lru"),
            "sim_lfu": sim_run(prepared, capacity, "lfu"),
            "sim_lfu_reset_colossalai": sim_run(prepared, capacity, "lfu_reset"),
            "sim_set_assoc_lru_32way_fbgemm": sim_run(prepared, capacity, "set_lru", ways=32),
            "cachedemb_lfu": module_run(trace, num_rows, capacity, "lfu", table_starts=table_starts),
            "cachedemb_lru": module_run(trace, num_rows, capacity, "lru", table_starts=table_starts),
        }
        for k in depths:
            for h in horizons:
                if h >= k:
                    rows[f"cachedemb_lookahead_H{h}_K{k}"] = module_run(trace, num_rows, capacity, "lookahead",
                                                                         horizon=h, depth=k,
                                                                         table_starts=table_starts)
            # The GPU default: the next window is admitted while the current one is in use (2K batches resident).
            h = max(horizons)
            if k > 1 and h >= 2 * k:
                rows[f"cachedemb_lookahead_H{h}_K{k}_overlap"] = module_run(
                    trace, num_rows, capacity, "lookahead", horizon=h, depth=k, table_starts=table_starts,
                    overlap=True)
        opt = rows["opt"]["rows_moved"]
        for r in rows.values():
            r["hit_rate"] = round(1 - r["rows_moved"] / max(1, r["unique_lookups"]), 5)
            r["over_opt"] = round(r["rows_moved"] / max(1, opt), 5)
        out["by_ratio"].append({"cache_ratio": ratio, "cache_rows": capacity, "policies": rows})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", nargs="+", default=["zipf1.05", "zipf1.2", "criteo"],
                   help="zipf<alpha> and/or criteo")
    p.add_argument("--trace-file", help="a user trace (.npy 2-D, .npz ids+batch_offsets, or text)")
    p.add_argument("--num-rows", type=int, default=2_000_000, help="rows of the Zipf traces' table")
    p.add_argument("--batch-lookups", type=int, default=8192)
    p.add_argument("--criteo-scale", type=float, default=0.1)
    p.add_argument("--criteo-batch", type=int, default=256, help="examples per batch (x 26 features)")
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.05])
    p.add_argument("--horizons", type=int, nargs="+", default=[1, 8, 16, 64])
    p.add_argument("--depths", type=int, nargs="+", default=[1, 4],
                   help="admission depths K: K=1 is OPT's own constraint, K>1 also holds the next K-1 batches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)

    traces = []
    if args.trace_file:
        trace = load_trace(args.trace_file)
        traces.append((args.trace_file, trace, int(max(b.max() for b in trace if len(b))) + 1, None))
    else:
        for name in args.traces:
            if name.startswith("zipf"):
                alpha = float(name[4:])
                trace = zipf_trace(args.num_rows, args.batch_lookups, args.batches, alpha, seed=args.seed)
                traces.append((name, trace, args.num_rows, None))
            elif name == "criteo":
                sizes = criteo_table_sizes(args.criteo_scale)
                trace = criteo_like_trace(sizes, args.criteo_batch, args.batches, seed=args.seed)
                traces.append((f"criteo_like_scale{args.criteo_scale}", trace, int(sum(sizes)),
                               table_offsets(sizes)[: len(sizes)]))
            else:
                raise SystemExit(f"unknown trace {name!r}: expected zipf<alpha> or criteo")
    report = {
        "benchmark": "cache_policy_rows_moved",
        "machine": {"platform": platform.platform(), "cpu_threads": torch.get_num_threads()},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "traces": [bench_trace(n, t, rows, args.ratios, args.horizons, args.depths, starts)
                   for n, t, rows, starts in traces],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
