#!/usr/bin/env python
"""Step time of a table on disk (cachedemb.FileStorage) against the same table in memory, and the file tier's I/O.

Shape (issue 23): 8M rows x dim 64 fp32, fused SGD, batches of 4096 x 26 Zipf(1.05) ids with hot ids scattered
(cachedemb.tools.traces.zipf_trace), a device cache of 1% of the rows (on CPU: the same memory), one torch thread.
The table file is created once under --dir (default /tmp) and deleted at the end. For each run, a file-backed
module warms up (its host cache fills and starts evicting), then blocks of steps alternate between it and an
in-memory CachedEmbeddingBag (no prefetch) on the same batches; each block's file I/O is drained inside its
time. Runs: host caches of 1/4 and 1/16 of the table, without and with cachedemb.prefetch (the horizon's misses
read from the file ahead on the I/O threads), and the 1/16 runs cold: the file's pages dropped from the OS page
cache (posix_fadvise(DONTNEED), not timed) before every block.

Per run: median seconds per step of each, the median of the block-by-block ratios, the file step over the
in-memory step timed before any file existed (`ratio_to_clean_memory`: the kernel's write-back of the file's dirty
pages also slows the memory blocks it lands in), rows/s read and written,
bytes read per step as requested from the file (records; `gap_bytes_read_per_step`: the bytes between records that
reads spanning nearby records copy besides) and as read from the disk (/proc/self/io read_bytes:
whole pages, cold runs), against the lower bound: the host cache's misses x record bytes.

    python scripts/bench_storage.py --out benchmarks/results/storage_cpu.json
    python scripts/bench_storage.py --rows 1000000 --warmup 10 --rounds 2     # a quick look
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
from cachedemb.storage import rowio
from cachedemb.tools.traces import zipf_trace


def disk_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def drain(module) -> None:
    """Wait for the file tier's reads and writes in flight (inside the timed span: no free I/O afterwards)."""
    module.host.fence()
    module.table.drain()


def rounds(file_mod, mem, batches, offsets, warmup: int, n_rounds: int, block: int, prefetch: dict | None,
           cold: bool, commits: int = 0) -> dict:
    """Warm the file-backed module up, then alternate blocks of `block` steps: the file-backed module (its
    I/O drained inside the block's time), then the in-memory one on the same batches. Ratios are taken block by
    block, so the shared machine's drift hits both alike."""
    source = iter(cachedemb.prefetch(batches, [file_mod], **prefetch) if prefetch else batches)
    for _ in range(warmup):
        file_mod(next(source), offsets).sum().backward()
    for _ in range(commits):  # checkpoints (untimed): older snapshots' blocks become the log's to clean
        file_mod.commit()
    drain(file_mod)
    marks = counters(file_mod)
    a_times, b_times, ratios = [], [], []
    for r in range(n_rounds):
        if cold:
            file_mod.table.drop_page_cache()
        chunk = []
        t = time.perf_counter()
        for _ in range(block):
            ids = next(source)
            chunk.append(ids)
            file_mod(ids, offsets).sum().backward()
        drain(file_mod)
        a = (time.perf_counter() - t) / block
        t = time.perf_counter()
        for ids in chunk:
            mem(ids, offsets).sum().backward()
        b = (time.perf_counter() - t) / block
        a_times.append(a), b_times.append(b), ratios.append(a / b)
    end = counters(file_mod)
    n = n_rounds * block
    elapsed = sum(a_times) * block
    misses = end["misses"] - marks["misses"]
    record = file_mod.table.record
    return {"step_s": statistics.median(a_times), "memory_step_s": statistics.median(b_times),
            "ratio_to_memory": statistics.median(ratios), "ratios": [round(x, 3) for x in ratios],
            "host_hit_rate": (end["hits"] - marks["hits"]) / max(1, end["hits"] - marks["hits"] + misses),
            "rows_read_per_s": (end["rows_read"] - marks["rows_read"]) / elapsed,
            "rows_written_per_s": (end["rows_written"] - marks["rows_written"]) / elapsed,
            "bytes_requested_per_step": (end["bytes_read"] - marks["bytes_read"]) / n,
            "disk_bytes_read_per_step": (end["disk"] - marks["disk"]) / n,
            "lower_bound_bytes_per_step": misses * record / n, "host_misses_per_step": misses / n,
            "read_calls_per_step": (end["read_calls"] - marks["read_calls"]) / n,
            "gap_bytes_read_per_step": (end.get("gap_bytes_read", 0) - marks.get("gap_bytes_read", 0)) / n,
            "blocks_copied": end["blocks_copied"] - marks["blocks_copied"],
            "rows_cleaned_per_step": (end.get("rows_cleaned", 0) - marks.get("rows_cleaned", 0)) / n,
            "blocks_cleaned": end.get("blocks_cleaned", 0) - marks.get("blocks_cleaned", 0),
            "file_bytes": end["file_bytes"]}


def counters(module) -> dict:
    stats = module.cache_stats()
    return dict(stats["file"], hits=stats["host_cache"]["hits"], misses=stats["host_cache"]["misses"],
                disk=disk_read_bytes())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--warmup", type=int, default=60, help="file-backed steps before timing (host cache filling)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=5, help="steps per timed block")
    p.add_argument("--fractions", type=int, nargs="+", default=[4, 16], help="host cache = table / F")
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--horizon", type=int, default=8)
    p.add_argument("--read-ahead", type=int, default=2,
                   help="FileStorage.read_ahead: horizon batches whose misses are read ahead under prefetch")
    p.add_argument("--io-threads", type=int, default=None,
                   help="FileStorage.io_threads (default: the library's)")
    p.add_argument("--log", choices=["auto", "on", "off"], default="auto",
                   help="FileStorage.log: write-backs appended (a log) or in place (auto: the library's choice)")
    p.add_argument("--log-slack", type=float, default=0.5, help="FileStorage.log_slack")
    p.add_argument("--commits-after-warmup", type=int, default=0,
                   help="snapshots committed after the warm-up (2: the log may clean every block dead since)")
    p.add_argument("--warm-only", action="store_true", help="skip the cold page cache runs")
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    io_threads = args.io_threads or cachedemb.FileStorage.io_threads
    steps = args.warmup + args.rounds * args.block
    trace = zipf_trace(args.rows, 4096 * 26, steps + args.horizon, 1.05, seed=0)
    batches = [torch.from_numpy(b).to(torch.int64) for b in trace]
    offsets = torch.arange(4096) * 26
    spec = cachedemb.optim.SGD(lr=0.01)
    cache_rows = args.rows // 100
    prefetch = {"depth": args.depth, "horizon": args.horizon}
    out = {"issue": 23, "num_rows": args.rows, "dim": args.dim, "batch": "4096 x 26 zipf 1.05 (scattered)",
           "optimizer": "fused SGD", "device_cache_rows": cache_rows, "warmup": args.warmup, "rounds": args.rounds,
           "block": args.block, "torch_threads": 1, "prefetch": prefetch, "read_ahead": args.read_ahead, "rowio": rowio.backend(),
           "io_threads": io_threads, "log": args.log, "log_slack": args.log_slack,
           "commits_after_warmup": args.commits_after_warmup,
           "machine": "CPU-only dev box, 2 cores, shared", "platform": platform.platform(),
           "method": "blocks of steps alternating file-backed / in-memory (no prefetch) on the same batches; "
                     "ratio per block pair, median", "runs": []}
    torch.manual_seed(0)
    mem = cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", cache_rows=cache_rows, optimizer=spec,
                                       device="cpu")
    for ids in batches[: args.warmup]:
        mem(ids, offsets).sum().backward()
    # The in-memory step before any file exists: on a page-cache file system the kernel writes the file's dirty
    # pages back in the background, which lands in whichever block runs (the memory blocks too).
    clean = []
    for r in range(args.rounds):
        t = time.perf_counter()
        for ids in batches[args.warmup + r * args.block: args.warmup + (r + 1) * args.block]:
            mem(ids, offsets).sum().backward()
        clean.append((time.perf_counter() - t) / args.block)
    out["memory_clean_step_s"] = statistics.median(clean)
    work = Path(tempfile.mkdtemp(prefix="cachedemb-bench-", dir=args.dir))
    path = work / "table.cemb"
    try:
        torch.manual_seed(0)
        t = time.perf_counter()
        creator = cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", cache_rows=cache_rows,
                                               optimizer=spec, device="cpu",
                                               storage=cachedemb.FileStorage(path, host_cache_bytes=64 << 20,
                                                                             log=False))  # each run picks
        out["create_s"] = time.perf_counter() - t
        table_bytes = creator.table.header.num_rows * creator.table.record
        out["table_bytes"], out["record_bytes"] = table_bytes, creator.table.record
        creator.close()
        os.sync()  # the creation's dirty pages reach the disk now, not in the background during timed blocks
        for fraction in args.fractions:
            for cold in ([False, True] if fraction == max(args.fractions) and not args.warm_only else [False]):
                for pf in (None, prefetch):
                    emb = cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", cache_rows=cache_rows,
                                                       optimizer=spec, device="cpu",
                                                       storage=cachedemb.FileStorage(
                                                           path, host_cache_bytes=table_bytes // fraction,
                                                           read_ahead=args.read_ahead, io_threads=io_threads,
                                                           log={"auto": None, "on": True, "off": False}[args.log],
                                                           log_slack=args.log_slack))
                    result = rounds(emb, mem, batches, offsets, args.warmup, args.rounds, args.block, pf, cold,
                                    args.commits_after_warmup)
                    name = f"file 1/{fraction}" + (" +prefetch" if pf else "") + (" cold" if cold else "")
                    result = dict(name=name, host_cache_bytes=table_bytes // fraction, log=emb.table.log is not None,
                                  host_rows=emb.host.base - emb.host.first, **result,
                                  ratio_to_clean_memory=result["step_s"] / out["memory_clean_step_s"])
                    out["runs"].append(result)
                    print(json.dumps(result), flush=True)
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
