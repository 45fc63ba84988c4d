"""How good the sizing tool's predictions are, and what they cost: prints JSON.

- `shards`: sampled (SHARDS) curves against exact ones on Zipf traces, per policy and rate: the largest absolute
  miss-ratio error over the curve's sizes, the reported standard error, and seconds for each.
- `module`: a plan's predicted rows moved per batch against a CachedEmbeddingBag trained on the same trace at
  the chosen rows (lfu; lookahead under cachedemb.prefetch).
- `plan`: seconds to plan a DLRM recipe data set (synthetic, generated here) at a budget.

    python scripts/bench_sizing.py --out benchmarks/results/sizing_cpu.json
    python scripts/bench_sizing.py --only shards --rows 10000000 --batches 400
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import cachedemb
from cachedemb import sizing
from cachedemb.tools.traces import zipf_trace


def bench_shards(args) -> list[dict]:
    out = []
    for alpha in args.alphas:
        trace = zipf_trace(args.rows, args.lookups, args.batches, alpha, seed=args.seed)
        for policy in args.policies:
            kw = {"horizon": 16, "depth": 1} if policy == "lookahead" else {}
            start = time.perf_counter()
            exact = sizing.miss_ratio_curve(trace, policy, points=args.points, **kw)
            exact_s = time.perf_counter() - start
            for rate in args.rates:
                for salt in range(args.salts):
                    start = time.perf_counter()
                    sampled = sizing.miss_ratio_curve(trace, policy, exact.sizes, sample_rate=rate, salt=salt, **kw)
                    seconds = time.perf_counter() - start
                    err = np.abs(sampled.miss_ratio - exact.miss_ratio)
                    out.append({"alpha": alpha, "policy": policy, "rate": rate, "salt": salt,
                                "distinct_ids": exact.distinct_ids, "unique_lookups": exact.unique_lookups,
                                "max_abs_error": round(float(err.max()), 5),
                                "mean_abs_error": round(float(err.mean()), 5),
                                "max_reported_stderr": round(sampled.max_stderr, 5),
                                "exact_seconds": round(exact_s, 3), "sampled_seconds": round(seconds, 3)})
                    print(json.dumps(out[-1]), flush=True)
    return out


def bench_module(args) -> list[dict]:
    torch.set_num_threads(1)
    out = []
    traces = {"a": zipf_trace(200_000, 4096, 100, 1.05, seed=1), "b": zipf_trace(50_000, 4096, 100, 0.9, seed=2)}
    tables = [cachedemb.TableConfig("a", 200_000, 32, ["a"]), cachedemb.TableConfig("b", 50_000, 32, ["b"])]
    for policy, prefetch in (("lfu", None), ("lookahead", {"depth": 4, "horizon": 16, "overlap": False})):
        start = time.perf_counter()
        p = sizing.plan(traces, 4 << 20, tables, groups=None, optimizer=cachedemb.optim.RowWiseAdagrad(0.1),
                        policy=policy, **(prefetch or {}))
        plan_s = time.perf_counter() - start
        for t in tables:
            emb = cachedemb.CachedEmbeddingBag(t.num_embeddings, t.embedding_dim, cache_rows=p.cache_rows[t.name],
                                               optimizer=cachedemb.optim.SGD(0.0))
            batches = [(torch.from_numpy(b), torch.tensor([0])) for b in traces[t.name]]
            src = batches if prefetch is None else cachedemb.prefetch(batches, [emb], **prefetch)
            for ids, offsets in src:
                emb(ids, offsets).sum().backward()
            measured = emb.cache_stats()["rows_in"] / len(batches)
            predicted = p.table(t.name).rows_per_batch
            out.append({"policy": policy, "prefetch": prefetch, "table": t.name, "cache_rows": p.cache_rows[t.name],
                        "predicted_rows_per_batch": round(predicted, 2), "measured_rows_per_batch": measured,
                        "relative_error": round(measured / predicted - 1, 5), "plan_seconds": round(plan_s, 2)})
            print(json.dumps(out[-1]), flush=True)
    return out


def bench_plan(args) -> dict:
    from cachedemb.recipes.dlrm.data import preprocess_criteo_kaggle, synthetic_criteo, write_criteo_tsv

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = synthetic_criteo(scale=1 / 25, min_large=5000, embedding_dim=16)
        write_criteo_tsv(root / "train.txt", args.recipe_rows, config.table_sizes, seed=0)
        data = preprocess_criteo_kaggle(root / "train.txt", root / "preprocessed", config=config, train_fraction=0.9,
                                        val_fraction=0.1)
        out = {"rows": args.recipe_rows, "batch_size": 2048, "tables": 26}
        for policy in ("lfu", "lookahead"):
            start = time.perf_counter()
            p = sizing.plan(str(data), 4 << 20, optimizer=cachedemb.optim.RowWiseAdagrad(0.1), policy=policy,
                            depth=4, horizon=16, batch_size=2048)
            out[policy] = {"seconds": round(time.perf_counter() - start, 2), "predicted_hit_rate": round(p.hit_rate, 4),
                           "split_nodes": p.split.nodes, "optimal": p.split.optimal}
        print(json.dumps(out), flush=True)
        return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["shards", "module", "plan"], nargs="+", default=["shards", "module", "plan"])
    p.add_argument("--rows", type=int, default=2_000_000, help="Zipf table rows (shards)")
    p.add_argument("--lookups", type=int, default=16384)
    p.add_argument("--batches", type=int, default=100)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.9, 1.05, 1.2])
    p.add_argument("--policies", nargs="+", default=["lru", "lfu", "opt"])
    p.add_argument("--rates", type=float, nargs="+", default=[0.01, 0.1])
    p.add_argument("--salts", type=int, default=3)
    p.add_argument("--points", type=int, default=16)
    p.add_argument("--recipe-rows", type=int, default=400_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)
    report = {"benchmark": "sizing", "machine": {"platform": platform.platform(), "cpu_threads": torch.get_num_threads()},
              "config": {k: v for k, v in vars(args).items() if k != "out"}}
    if "shards" in args.only:
        report["shards"] = bench_shards(args)
    if "module" in args.only:
        report["module"] = bench_module(args)
    if "plan" in args.only:
        report["plan"] = bench_plan(args)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
