"""The floor a file-backed step cannot go below on this machine: the in-memory step with only the file tier's
record I/O beside it, no file-tier bookkeeping at all.

`bench_storage.py` times the file-backed module against the in-memory one. This asks what part of that ratio is
the design's bookkeeping and what part is the kernel's work for the records themselves. It first runs the
file-backed module (host cache 1/F of the table, with prefetch) to count the records it reads and writes per
step, then alternates blocks of steps: the in-memory module alone, and the in-memory module while I/O threads
read and write that many records of the same table file per step (random rows, sorted by offset, one `pread` /
`pwrite` per record through `rowio`, as the tier issues them; the table is a scratch file, removed at the end),
each step waiting for its I/O as the tier's step waits for its misses and write-backs. Per
mode: reads only, writes only, both; the median block ratio to the in-memory step, and each thread's CPU time
per step (the kernel's per-record cost and the CPU-throughput floor: all CPU work of a step spread over the
cores). `--log-writes` adds the modes a log-structured file would have: the step's written records appended to
a log beside the table (sequential `pwrite`s of 256 KiB) instead of written in place, with and without the
reads, each next to a mode writing in place in the same run.

    OMP_NUM_THREADS=1 python scripts/bench_io_floor.py --dir /tmp/io --out benchmarks/results/io_floor.json
    OMP_NUM_THREADS=1 python scripts/bench_io_floor.py --dir /tmp/io --log-writes --out ...
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

import cachedemb
from cachedemb.storage import rowio
from cachedemb.tools.traces import zipf_trace


def records_per_step(path, rows, dim, cache_rows, spec, table_bytes, fraction, batches, offsets, warmup,
                     steps) -> dict:
    """Rows the file-backed module (host cache 1/fraction, prefetch depth 1 horizon 8) reads and writes per step
    once warm; the writes counted after the I/O in flight is drained."""
    emb = cachedemb.CachedEmbeddingBag(rows, dim, mode="sum", cache_rows=cache_rows, optimizer=spec, device="cpu",
                                       storage=cachedemb.FileStorage(path, host_cache_bytes=table_bytes // fraction))
    try:
        source = iter(cachedemb.prefetch(batches, [emb], depth=1, horizon=8))
        for _ in range(warmup):
            emb(next(source), offsets).sum().backward()
        emb.host.fence(), emb.table.drain()
        a = dict(emb.cache_stats()["file"])
        t = time.perf_counter()
        for _ in range(steps):
            emb(next(source), offsets).sum().backward()
        emb.host.fence(), emb.table.drain()
        wall = (time.perf_counter() - t) / steps
        b = emb.cache_stats()["file"]
        return {"reads": (b["rows_read"] - a["rows_read"]) / steps,
                "writes": (b["rows_written"] - a["rows_written"]) / steps, "file_step_s": wall}
    finally:
        emb.close()


LOG_PIECE = 1 << 18  # bytes a log append writes per call


class RecordIo:
    """One step's record I/O on the table file: `n` random rows read or written, each a `pread`/`pwrite` of one
    record at its offset, sorted by offset, or appended to a log file (`append`); the CPU seconds of each kind
    counted."""

    def __init__(self, path, rows: int, seed: int = 1):
        self._table = cachedemb.storage.table_file.TableFile.open(path, writable=False)
        self.record = self._table.record
        self.fd = os.open(path, os.O_RDWR)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.rows, self.rng = rows, np.random.default_rng(seed)
        self.cpu = {"read": 0.0, "write": 0.0, "append": 0.0}
        self.log_path = f"{path}.log"
        self.log_fd = os.open(self.log_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.log_end = 0

    def job(self, kind: str, n: int) -> None:
        start = time.thread_time()
        ids = np.unique(self.rng.integers(0, self.rows, n))
        offsets = np.ascontiguousarray(self._table.row_offsets(ids), np.int64)
        spans = np.arange(ids.size + 1, dtype=np.int64)
        buf = np.zeros(ids.size * self.record, np.uint8)
        if kind == "read":
            rowio.pread_spans(self.fd, offsets, spans, self.record, buf)
        elif kind == "append":  # the records packed in id order at the log's end, as a log-structured write-back
            view = memoryview(buf)
            for at in range(0, len(view), LOG_PIECE):
                self.log_end += os.pwrite(self.log_fd, view[at: at + LOG_PIECE], self.log_end)
        else:
            rowio.pwrite_spans(self.fd, offsets, spans, self.record, buf)
        self.cpu[kind] += time.thread_time() - start

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.log_fd)
        os.unlink(self.log_path)
        self._table.close()


def floor_mode(mem, io: RecordIo, batches, offsets, start: int, reads: int, writes: int, rounds: int,
               block: int, write_kind: str = "write") -> dict:
    """Alternating blocks: the in-memory step alone, then with `reads` and `writes` records of I/O per step (the
    writes in place, or appended to the log: `write_kind` "append")."""
    pool = ThreadPoolExecutor(2)
    alone, beside, main_cpu = [], [], 0.0
    io.cpu = {"read": 0.0, "write": 0.0, "append": 0.0}
    at = start
    try:
        for _ in range(rounds):
            chunk = batches[at: at + block]
            at += block
            t = time.perf_counter()
            for ids in chunk:
                mem(ids, offsets).sum().backward()
            alone.append((time.perf_counter() - t) / block)
            t, c = time.perf_counter(), time.thread_time()
            for ids in chunk:
                jobs = ([pool.submit(io.job, "read", reads)] if reads else []) + \
                       ([pool.submit(io.job, write_kind, writes)] if writes else [])
                mem(ids, offsets).sum().backward()
                for j in jobs:
                    j.result()
            beside.append((time.perf_counter() - t) / block)
            main_cpu += time.thread_time() - c
    finally:
        pool.shutdown()
    steps = rounds * block
    ratios = [b / a for a, b in zip(alone, beside)]
    return {"reads_per_step": reads, "writes_per_step": writes, "writes_as": write_kind,
            "memory_step_s": statistics.median(alone), "with_io_step_s": statistics.median(beside),
            "ratio_to_memory": statistics.median(ratios), "ratios": [round(x, 3) for x in ratios],
            "cpu_ms_per_step": {"training": 1e3 * main_cpu / steps, "read": 1e3 * io.cpu["read"] / steps,
                                "write": 1e3 * io.cpu[write_kind] / steps},
            "us_per_record": {"read": 1e6 * io.cpu["read"] / max(1, steps * reads),
                              "write": 1e6 * io.cpu[write_kind] / max(1, steps * writes)}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--fraction", type=int, default=16, help="host cache = table / F for the record counts")
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--count-steps", type=int, default=30, help="file-backed steps counted for records per step")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--block", type=int, default=5)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--machine", default="CPU-only dev box, 2 cores, shared")
    p.add_argument("--log-writes", action="store_true",
                   help="also time the writes appended to a log (a log-structured file's write-back)")
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    modes = [("reads", True, False, "write"), ("writes", False, True, "write"), ("reads+writes", True, True, "write")]
    if args.log_writes:
        modes += [("writes appended", False, True, "append"), ("reads+writes appended", True, True, "append"),
                  ("reads+writes", True, True, "write")]
    need = args.warmup + args.count_steps + 8 + 1 + args.warmup + len(modes) * args.rounds * args.block
    trace = zipf_trace(args.rows, 4096 * 26, need, 1.05, seed=0)
    batches = [torch.from_numpy(b).to(torch.int64) for b in trace]
    offsets = torch.arange(4096) * 26
    spec = cachedemb.optim.SGD(lr=0.01)
    cache_rows = args.rows // 100
    out = {"issue": 23, "num_rows": args.rows, "dim": args.dim, "batch": "4096 x 26 zipf 1.05 (scattered)",
           "optimizer": "fused SGD", "device_cache_rows": cache_rows, "host_cache_fraction": args.fraction,
           "torch_threads": 1, "cores": os.cpu_count(), "rowio": rowio.backend(), "machine": args.machine,
           "platform": platform.platform(), "method": __doc__.split("\n\n")[1].replace("\n", " "), "modes": []}
    work = Path(tempfile.mkdtemp(prefix="cachedemb-floor-", dir=args.dir))
    path = work / "table.cemb"
    try:
        torch.manual_seed(0)
        creator = cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", cache_rows=cache_rows,
                                               optimizer=spec, device="cpu",
                                               storage=cachedemb.FileStorage(path, host_cache_bytes=64 << 20))
        table_bytes = args.rows * creator.table.record
        creator.close()
        os.sync()
        counted = records_per_step(path, args.rows, args.dim, cache_rows, spec, table_bytes, args.fraction, batches,
                                   offsets, args.warmup, args.count_steps)
        out["file_backed"] = counted
        print(json.dumps({"file_backed": counted}), flush=True)
        torch.manual_seed(0)
        mem = cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", cache_rows=cache_rows, optimizer=spec,
                                           device="cpu")
        start = args.warmup + args.count_steps + 9
        for ids in batches[start: start + args.warmup]:
            mem(ids, offsets).sum().backward()
        start += args.warmup
        io = RecordIo(path, args.rows)
        try:
            for name, r, w, kind in modes:
                result = floor_mode(mem, io, batches, offsets, start, round(counted["reads"]) if r else 0,
                                    round(counted["writes"]) if w else 0, args.rounds, args.block, kind)
                start += args.rounds * args.block
                cpu = result["cpu_ms_per_step"]
                # all the CPU work of a step spread over every core: no schedule does better
                result["cpu_throughput_floor"] = sum(cpu.values()) / os.cpu_count() / (1e3 * result["memory_step_s"])
                result["mode"] = name
                out["modes"].append(result)
                print(json.dumps(result), flush=True)
        finally:
            io.close()
        out["file_backed_ratio_estimate"] = counted["file_step_s"] / out["modes"][2]["memory_step_s"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
