"""Sharded training throughput on CPU gloo ranks: samples/s (global) and bytes each rank sends per step.

    python scripts/bench_distributed.py --ranks 1 2 4 --out benchmarks/results/bench_distributed_cpu.json

One row-wise table and two table-wise tables (fused Adagrad), a dense layer under DDP; each rank trains its
own local batch. Bytes are the embedding exchanges' (ids, counts, pooled rows, gradients), forward and
backward, a rank's own share to itself excluded; DDP's all-reduce is not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from torch import nn

import cachedemb
from cachedemb.distributed import ShardingPlan, TableSharding, exchange_stats, shard
from cachedemb.distributed.testing import run_spawned


class _Model(nn.Module):
    def __init__(self, rows: int, dim: int):
        super().__init__()
        opt = cachedemb.optim.Adagrad(lr=0.05)
        self.big = cachedemb.CachedEmbeddingBag(rows, dim, mode="sum", cache_ratio=0.1, optimizer=opt, device="cpu")
        self.t1 = cachedemb.CachedEmbeddingBag(rows // 10, dim, mode="sum", cache_ratio=0.1, optimizer=opt,
                                               device="cpu")
        self.t2 = cachedemb.CachedEmbeddingBag(rows // 10, dim, mode="sum", cache_ratio=0.1, optimizer=opt,
                                               device="cpu")
        self.dense = nn.Linear(3 * dim, 1)

    def forward(self, ids, offsets):
        return self.dense(torch.cat([self.big(ids, offsets), self.t1(ids % self.t1.num_embeddings, offsets),
                                     self.t2(ids % self.t2.num_embeddings, offsets)], 1))


def _worker(rank: int, world: int, rows: int, dim: int, batch: int, pooling: int, steps: int, warmup: int):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plan = ShardingPlan(world, {"big": TableSharding.row_wise(rows, world),
                                "t1": TableSharding.table_wise(rows // 10, 0, world),
                                "t2": TableSharding.table_wise(rows // 10, (world - 1), world)})
    model = shard(_Model(rows, dim), plan)
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    g = torch.Generator().manual_seed(rank)
    offsets = torch.arange(batch) * pooling
    batches = [torch.randint(0, rows, (batch * pooling,), generator=g) for _ in range(4)]
    for step in range(warmup + steps):
        if step == warmup:
            torch.distributed.barrier()
            start, sent = time.perf_counter(), exchange_stats.bytes_sent
        model(batches[step % 4], offsets).sum().backward()
        sgd.step(), sgd.zero_grad()
    torch.distributed.barrier()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "bytes_sent_per_step": (exchange_stats.bytes_sent - sent) / steps}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=512, help="local batch (bags) per rank")
    p.add_argument("--pooling", type=int, default=8, help="ids per bag")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    runs = []
    for world in args.ranks:
        per_rank = run_spawned(_worker, world, args.rows, args.dim, args.batch, args.pooling, args.steps,
                               args.warmup, timeout_s=300)
        seconds = max(r["seconds"] for r in per_rank)
        runs.append({"ranks": world, "samples_per_s": world * args.batch * args.steps / seconds,
                     "step_ms": 1000 * seconds / args.steps,
                     "bytes_sent_per_step_per_rank": [r["bytes_sent_per_step"] for r in per_rank]})
    result = {"benchmark": "bench_distributed", "backend": "gloo", "device": "cpu",
              "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                          "cpu_count": os.cpu_count(), "torch": torch.__version__},
              "config": vars(args), "runs": runs,
              "note": "ranks share the machine's cores (one thread each): past cpu_count ranks the processes "
                      "time-share, so samples/s measures exchange overhead, not scaling"}
    text = json.dumps(result, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
