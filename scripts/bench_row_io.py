#!/usr/bin/env python
"""Kernel cost of the file tier's row I/O: one table record read or written at a random offset, page cache warm.

A file-backed table's host-cache misses are records scattered over the file, so each is one positional read, and
each dirty row evicted is one positional write (`cachedemb.storage.rowio`, the loop the reader and writer threads
run). This times that loop on a file of `--rows` records of `--record` bytes (default: the 8M x 64 fp32 + SGD
table of scripts/bench_storage.py, 264-byte records) in the page cache: microseconds per record read and written,
on one thread, and what a step of `--misses` reads and `--writes` writes then costs in kernel time (the defaults:
the 1/16 host cache of bench_storage's shape, ~14.6k misses and as many dirty rows written back a step). That is a floor for
the file tier on a machine with few cores: those milliseconds run on cores the training step does not use, or
take turns with it.

    python scripts/bench_row_io.py --dir /tmp --out benchmarks/results/row_io_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from cachedemb.storage import rowio


def time_loop(fn, fd, offsets: np.ndarray, record: int, buf: np.ndarray) -> float:
    """Seconds per record of `fn` over single-record spans at `offsets`."""
    starts = np.arange(offsets.size + 1, dtype=np.int64)
    t = time.perf_counter()
    fn(fd, offsets, starts, record, buf)
    return (time.perf_counter() - t) / offsets.size


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8_000_000)
    p.add_argument("--record", type=int, default=264, help="record bytes")
    p.add_argument("--batch", type=int, default=16384, help="records per timed call")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--misses", type=float, default=14_600, help="records read per step, for the step estimate")
    p.add_argument("--writes", type=float, default=14_600, help="records written per step, for the estimate")
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--machine", default="CPU-only dev box, 2 cores, 24 GiB (shared host)")
    p.add_argument("--out")
    args = p.parse_args()
    path = Path(tempfile.mkdtemp(prefix="cachedemb-rowio-", dir=args.dir)) / "rows.bin"
    size = args.rows * args.record
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        # Filled a page at a time: the page cache then holds single pages, as it does for a table file's
        # pages read back under random-access advice (large writes leave large folios, and a record written
        # into one dirties all of it).
        page = np.zeros(1 << 20, dtype=np.uint8)
        for at in range(0, size, page.size):
            n = min(page.size, size - at)
            for sub in range(0, n, 4096):
                os.pwrite(fd, memoryview(page[: min(4096, n - sub)]), at + sub)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        rng = np.random.default_rng(0)
        buf = np.empty(args.batch * args.record, dtype=np.uint8)
        reads, writes = [], []
        for _ in range(args.repeats):
            offsets = np.sort(rng.choice(args.rows, args.batch, replace=False)).astype(np.int64) * args.record
            reads.append(time_loop(rowio.pread_spans, fd, offsets, args.record, buf))
            offsets = np.sort(rng.choice(args.rows, args.batch, replace=False)).astype(np.int64) * args.record
            writes.append(time_loop(rowio.pwrite_spans, fd, offsets, args.record, buf))
        read_us, write_us = 1e6 * statistics.median(reads), 1e6 * statistics.median(writes)
        out = {"benchmark": "row_io", "rowio": rowio.backend(), "rows": args.rows, "record_bytes": args.record,
               "records_per_call": args.batch, "repeats": args.repeats, "machine": args.machine,
               "platform": platform.platform(), "read_us_per_record": round(read_us, 3),
               "write_us_per_record": round(write_us, 3),
               "read_us_all": [round(1e6 * x, 3) for x in reads], "write_us_all": [round(1e6 * x, 3) for x in writes],
               "step_estimate": {"misses": args.misses, "writes": args.writes,
                                 "kernel_ms_per_step": round((args.misses * read_us + args.writes * write_us) / 1e3,
                                                             2)}}
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
        path.parent.rmdir()
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
