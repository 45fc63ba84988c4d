"""Preprocessing throughput (raw Criteo TSV lines/s) per worker count; JSON out (benchmarks/results).

Writes a synthetic Criteo-format data set (Criteo Kaggle's table sizes scaled down, real format) as `--days`
plain day files plus one gzipped day, preprocesses it with each `--workers` count, and checks that every run
wrote the same bytes as the first. Wall-clock time of the whole call: line counting, parsing, writing and the
train id counts."""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

from cachedemb.recipes.dlrm.data import preprocess_criteo_1tb, synthetic_criteo, write_criteo_tsv
from cachedemb.recipes.dlrm.data.parallel import default_workers


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for name in sorted(os.listdir(out)):
        if name != "metadata.json":
            h.update(name.encode() + (out / name).read_bytes())
    return h.hexdigest()


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the worker pools)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows-per-day", type=int, default=150_000)
    p.add_argument("--days", type=int, default=3, help="plain day files; one more day is gzipped")
    p.add_argument("--workers", default=None, help="comma-separated counts (default: 1 .. all cores)")
    p.add_argument("--split-mb", type=float, default=8.0, help="unit size of plain files, MiB")
    p.add_argument("--repeats", type=int, default=2, help="runs per count; the fastest is reported")
    p.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = p.parse_args(argv)
    counts = ([int(w) for w in args.workers.split(",")] if args.workers
              else list(range(1, default_workers() + 1)))
    config = synthetic_criteo(scale=1 / 25, min_large=5000)
    root = Path(tempfile.mkdtemp(prefix="bench_preprocess_"))
    try:
        days = []
        for d in range(args.days + 1):
            days.append(root / f"day_{d}")
            write_criteo_tsv(days[-1], args.rows_per_day, config.table_sizes, seed=d)
        gz = root / f"day_{args.days}.gz"
        gz.write_bytes(gzip.compress(days[-1].read_bytes(), compresslevel=6))
        os.remove(days[-1])
        days[-1] = gz
        lines = args.rows_per_day * (args.days + 1)
        load = os.getloadavg()[0]
        results, reference = [], None
        for w in counts:
            best, cpu = float("inf"), float("inf")
            for _ in range(args.repeats):
                start, cpu0 = time.perf_counter(), cpu_seconds()
                out = preprocess_criteo_1tb(days, root / "out", config=config, workers=w, overwrite=True,
                                            split_bytes=int(args.split_mb * (1 << 20)))
                best = min(best, time.perf_counter() - start)
                cpu = min(cpu, cpu_seconds() - cpu0)
            h = digest(out)
            reference = reference or h
            results.append({"workers": w, "seconds": round(best, 3), "lines_per_s": round(lines / best),
                            "cpu_seconds": round(cpu, 3), "lines_per_cpu_s": round(lines / cpu),
                            "same_bytes_as_first": h == reference})
        base = results[0]["lines_per_s"]
        for r in results:
            r["speedup_vs_first"] = round(r["lines_per_s"] / base, 2)
        report = {
            "benchmark": "preprocess_criteo_1tb lines/s per worker count",
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores visible, "
                       f"{default_workers()} usable; shared with other jobs (load average {load:.1f} at start): "
                       "noisy",
            "python": platform.python_version(),
            "lines": lines, "files": [p.name for p in days], "split_mb": args.split_mb,
            "repeats": args.repeats, "load_average_at_end": round(os.getloadavg()[0], 1), "results": results,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
