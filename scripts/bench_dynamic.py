"""CPU step time of a dynamic-id table vs a plain cached table on the same batches, and IdIndex lookups/s.

The plain table sees dense ids in [0, rows); the dynamic one sees the same ids scrambled to raw 64-bit values
(mix64), with capacity = rows, so both hold the same rows behind the same cache. JSON out (benchmarks/results)."""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import cachedemb
from cachedemb.dynamic import DynamicIds, IdIndex, mix64


def step_seconds(module, batches, warmup):
    for i, (ids, offsets) in enumerate(batches):
        if i == warmup:
            start = time.perf_counter()
        module(ids, offsets).sum().backward()
    return (time.perf_counter() - start) / (len(batches) - warmup)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--bag", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/dynamic_cpu.json")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    zipf = 1.0 / torch.arange(1, args.rows + 1, dtype=torch.float64) ** 1.05
    n = args.batch * args.bag
    dense = [torch.multinomial(zipf, n, replacement=True) for _ in range(args.steps)]
    offsets = torch.arange(0, n, args.bag)
    kw = dict(mode="sum", optimizer=cachedemb.optim.RowWiseAdagrad(lr=0.01), cache_ratio=0.1)
    plain = cachedemb.CachedEmbeddingBag(args.rows, args.dim, **kw)
    dyn = cachedemb.CachedEmbeddingBag(None, args.dim, dynamic=DynamicIds(capacity=args.rows), **kw)
    t_plain = step_seconds(plain, [(d, offsets) for d in dense], args.warmup)
    t_dyn = step_seconds(dyn, [(mix64(d), offsets) for d in dense], args.warmup)

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
        "device": "cpu", "torch": torch.__version__, "machine": platform.machine(), "threads": torch.get_num_threads(),
        "rows": args.rows, "dim": args.dim, "lookups_per_batch": n, "bags": args.batch, "steps": args.steps,
        "plain_step_ms": 1e3 * t_plain, "dynamic_step_ms": 1e3 * t_dyn, "ratio": t_dyn / t_plain,
        "target_ratio": 1.3, "index_lookups_per_s": lookups_per_s, "index_max_probe": index.max_disp,
        "dynamic_stats": dyn.dynamic_stats(),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
