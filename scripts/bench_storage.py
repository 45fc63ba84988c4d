#!/usr/bin/env python
"""Step time of a table on disk (cachedemb.FileStorage) against the same table in memory, and the file tier's I/O.

Shape (issue 23): 8M rows x dim 64 fp32, fused SGD, batches of 4096 x 26 Zipf(1.05) ids with hot ids scattered
(cachedemb.tools.traces.zipf_trace), a device cache of 1% of the rows (on CPU: the same memory), one torch thread.
Runs, each after a warm-up that brings the host cache to its steady state (evicting every batch):

- memory, memory+prefetch: CachedEmbeddingBag with the table in host memory (the baseline);
- file at host caches of 1/4 and 1/16 of the table, without and with cachedemb.prefetch (the horizon's misses read
  from the file ahead, on the I/O threads);
- cold: the 1/16 runs again with the file's pages dropped from the OS page cache before every timed step
  (posix_fadvise(DONTNEED); the drop itself is not timed).

Per run: median wall seconds per step, the ratio to the in-memory step, rows/s read and written, bytes read per
step as requested from the file (records) and as read from the disk (/proc/self/io read_bytes: pages, cold runs),
against the lower bound (the host cache's misses x record bytes). The table file is created once under --dir
(default /tmp) and deleted at the end.

    python scripts/bench_storage.py --out benchmarks/results/storage_cpu.json
    python scripts/bench_storage.py --rows 1000000 --steps 4 --warmup 6     # a quick look
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import cachedemb
from cachedemb.tools.traces import zipf_trace


def disk_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def run(module, batches, offsets, warmup: int, prefetch: dict | None, cold: bool) -> dict:
    """Median step time over the batches after `warmup`, with the module's file counters over the timed steps."""
    times, marks, end = [], {}, {}
    source = cachedemb.prefetch(batches, [module], **prefetch) if prefetch else batches
    # Reads for batch b are issued when it is read ahead (at batch b - horizon under prefetch): the timed
    # batches' I/O is counted over the same span of iterations, shifted.
    shift = prefetch["horizon"] if prefetch else 0
    start = time.perf_counter()
    for i, ids in enumerate(source):
        if i == max(0, warmup - shift) and hasattr(module, "table"):
            marks = counters(module)
        if i == len(batches) - shift and marks:
            end = counters(module)
        if i >= warmup and cold:
            module.table.drop_page_cache()
            start = time.perf_counter()
        module(ids, offsets).sum().backward()
        now = time.perf_counter()
        if i >= warmup:
            times.append(now - start)
        start = time.perf_counter()
    out = {"step_s": statistics.median(times), "step_s_all": [round(t, 4) for t in times]}
    if marks:
        end, n = end or counters(module), len(times)
        record = module.table.record
        elapsed = sum(times)
        misses = end["misses"] - marks["misses"]
        out.update(host_hit_rate=(end["hits"] - marks["hits"]) / max(1, end["hits"] - marks["hits"] + misses),
                   rows_read_per_s=(end["rows_read"] - marks["rows_read"]) / elapsed,
                   rows_written_per_s=(end["rows_written"] - marks["rows_written"]) / elapsed,
                   bytes_requested_per_step=(end["bytes_read"] - marks["bytes_read"]) / n,
                   disk_bytes_read_per_step=(end["disk"] - marks["disk"]) / n,
                   lower_bound_bytes_per_step=misses * record / n,
                   host_misses_per_step=misses / n, read_calls_per_step=(end["read_calls"] - marks["read_calls"]) / n,
                   blocks_copied=end["blocks_copied"] - marks["blocks_copied"])
    return out


def counters(module) -> dict:
    stats = module.cache_stats()
    return dict(stats["file"], hits=stats["host_cache"]["hits"], misses=stats["host_cache"]["misses"],
                disk=disk_read_bytes())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--warmup", type=int, default=24)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fractions", type=int, nargs="+", default=[4, 16], help="host cache = table / F")
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--horizon", type=int, default=8)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    lookups = 4096 * 26
    trace = zipf_trace(args.rows, lookups, args.warmup + args.steps, 1.05, seed=0)
    batches = [torch.from_numpy(b).to(torch.int64) for b in trace]
    offsets = torch.arange(4096) * 26
    spec = cachedemb.optim.SGD(lr=0.01)
    cache_rows = args.rows // 100
    prefetch = {"depth": args.depth, "horizon": args.horizon}
    out = {"issue": 23, "num_rows": args.rows, "dim": args.dim, "batch": "4096 x 26 zipf 1.05 (scattered)",
           "optimizer": "fused SGD", "device_cache_rows": cache_rows, "warmup": args.warmup, "steps": args.steps,
           "torch_threads": 1, "prefetch": prefetch, "machine": "CPU-only dev box, 2 cores, shared",
           "platform": platform.platform(), "runs": []}

    def record(name, result, **extra):
        result = dict(name=name, **extra, **result)
        out["runs"].append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "step_s_all"}), flush=True)

    torch.manual_seed(0)
    mem = cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", cache_rows=cache_rows, optimizer=spec,
                                       device="cpu")
    record("memory", run(mem, batches, offsets, args.warmup, None, False))
    record("memory+prefetch", run(mem, batches, offsets, args.warmup, prefetch, False))
    base = out["runs"][0]["step_s"]
    del mem
    gc.collect()

    work = Path(tempfile.mkdtemp(prefix="cachedemb-bench-", dir=args.dir))
    path = work / "table.cemb"
    try:
        torch.manual_seed(0)
        t = time.perf_counter()
        creator = cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", cache_rows=cache_rows,
                                               optimizer=spec, device="cpu",
                                               storage=cachedemb.FileStorage(path, host_cache_bytes=64 << 20))
        out["create_s"] = time.perf_counter() - t
        table_bytes = creator.table.header.num_rows * creator.table.record
        out["table_bytes"], out["record_bytes"] = table_bytes, creator.table.record
        creator.close()
        for fraction in args.fractions:
            for cold in ([False, True] if fraction == max(args.fractions) else [False]):
                for pf in (None, prefetch):
                    emb = cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", cache_rows=cache_rows,
                                                       optimizer=spec, device="cpu",
                                                       storage=cachedemb.FileStorage(
                                                           path, host_cache_bytes=table_bytes // fraction))
                    result = run(emb, batches, offsets, args.warmup, pf, cold)
                    result["ratio_to_memory"] = result["step_s"] / base
                    name = f"file 1/{fraction}" + (" +prefetch" if pf else "") + (" cold" if cold else "")
                    record(name, result, host_cache_bytes=table_bytes // fraction,
                           host_rows=emb.host.base - emb.host.first)
                    emb.close()
                    del emb
                    gc.collect()
        out["file_bytes_at_end"] = path.stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
