#!/usr/bin/env python
"""Training-step time with and without cachedemb.prefetch, CPU: does the look-ahead pay for itself?

One CachedEmbeddingBag (default 8M rows x 64, fused SGD, 1 torch thread) trained on Zipf(1.05) batches of
4096 x 26 ids with the hot ids scattered over the table. Per cache ratio, depth and horizon, two modules with the
same init step the same batches alternately (paired: the shared box's load hits both alike), one plain, one
through `cachedemb.prefetch(batches, [emb], depth=K, horizon=H)`; after `--warmup` batches (the caches fill) the
next `--batches` steps are timed: wall time per step and the training thread's CPU time, rows moved host->device,
hit rate (1 - rows moved / distinct ids looked up, so runs with and without windows compare), window sizes, the
host milliseconds per batch of every cache and pipeline stage (`cache_stats()["seconds"]`), and whether the two
tables end bit-identical. Also device launches per step (cachedemb/tools/launch_count.py) with and without
prefetch. Prints JSON; `--out` writes it.

    python scripts/bench_prefetch.py --trace-cache /tmp/zipf_trace.npy --out benchmarks/results/prefetch.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import cachedemb
from cachedemb.modules.cache_stats import flat_seconds
from cachedemb.sizing.simulators import simulate_opt
from cachedemb.tools.traces import zipf_trace


def load_trace(args) -> list[torch.Tensor]:
    """The batches' ids (flat, 4096 x 26 each), generated once and kept in `--trace-cache` if given: the steps
    run, and as many again as the pipeline reads ahead (horizon + 2 x depth), so that it reads a batch in every
    timed step as in a long run."""
    count = args.warmup + args.batches + max(args.horizons) + 2 * max(args.depths) + 1
    path = args.trace_cache
    if path and os.path.exists(path):
        stored = np.load(path, mmap_mode="r")
        if stored.shape[0] >= count and stored.shape[1] == args.bags * args.bag_len:
            return [torch.from_numpy(np.array(stored[i])) for i in range(count)]
    trace = np.stack(zipf_trace(args.rows, args.bags * args.bag_len, count, args.alpha, seed=args.seed))
    if path:
        np.save(path, trace)
    return [torch.from_numpy(b) for b in trace]


def make_module(args, ratio: float):
    torch.manual_seed(0)  # the same init for both modules of a pair
    return cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", cache_ratio=ratio, device="cpu",
                                        optimizer=cachedemb.optim.SGD(lr=0.01))


def summary(emb, wall: list[float], thread: list[float]) -> dict:
    steps = len(wall)
    stats = emb.cache_stats()
    return {
        "step_ms": round(1000 * sum(wall) / steps, 2),
        "step_ms_median": round(1000 * statistics.median(wall), 2),
        "thread_cpu_ms": round(1000 * sum(thread) / steps, 2),
        "rows_moved": stats["rows_in"], "unique_lookups": stats["unique"],
        "hit_rate": round(stats["hit_rate"], 4) if stats["unique"] else 0.0,
        # the forwards' own view: rows a window moved in ahead count as found
        "forward_hit_rate": round((stats["hits"] + stats["window_misses"]) / max(1, stats["unique"]), 4),
        "windows": stats["windows"],
        # host-thread milliseconds per batch of every cache and pipeline stage (the read-ahead thread's included)
        "stage_ms_per_batch": {k: round(1000 * v / steps, 3) for k, v in flat_seconds(stats["seconds"]).items()
                               if v},
    }


def rows_moved(emb) -> int:
    """Rows moved host->device plus rows served from the host, since the last stats reset."""
    stats = emb.cache_stats()
    return stats["rows_in"] + stats["host_rows"]


def opt_ratios(batches: list[torch.Tensor], capacity: int, window_batches: list[int], moved: dict) -> dict:
    """Rows moved / batch-granular Belady-OPT (cachedemb.sizing.simulators.simulate_opt): the plain module against
    OPT per batch, the prefetched one against OPT over the windows the pipeline admitted (0: one batch)."""
    windows, start = [], 0
    for count in window_batches:
        k = max(count, 1)
        if start >= len(batches):
            break
        windows.append(torch.cat(batches[start:start + k]).numpy())
        start += k
    opt_batches = simulate_opt([b.numpy() for b in batches], capacity).rows_moved
    opt_windows = simulate_opt(windows, capacity).rows_moved
    return {"none": round(moved["none"] / max(1, opt_batches), 4),
            "prefetch": round(moved["prefetch"] / max(1, opt_windows), 4),
            "opt_rows_per_batch": opt_batches, "opt_rows_per_window": opt_windows}


def paired_ratio_median(prefetch: list[float], none: list[float], group: int) -> float:
    sums = [(sum(prefetch[i:i + group]), sum(none[i:i + group])) for i in range(0, len(none) - group + 1, group)]
    return round(statistics.median(p / n for p, n in sums), 3)


def run_pair(trace: list[torch.Tensor], args, ratio: float, depth: int, horizon: int) -> dict:
    """The same batches stepped alternately through a module without prefetch and one through
    `cachedemb.prefetch(..., depth, horizon)` (which goes first alternates too), so the shared box's load hits
    both alike. A prefetch step is everything between two batches: `next()` of the pipeline (its admissions)
    and the forward and backward."""
    plain, ahead = make_module(args, ratio), make_module(args, ratio)
    offsets = torch.arange(args.bags) * args.bag_len
    pipe = cachedemb.prefetch(trace, [ahead], depth=depth, horizon=horizon)
    it = iter(pipe)
    times = {"none": ([], []), "prefetch": ([], [])}
    process_start = None

    def step(mode: str, i: int, timed: bool) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        if mode == "none":
            plain(trace[i], offsets).sum().backward()
        else:
            ids = next(it)
            ahead(ids, offsets).sum().backward()
        if timed:
            times[mode][0].append(time.perf_counter() - t0)
            times[mode][1].append(time.thread_time() - c0)

    before_reset = {}
    for i in range(args.warmup + args.batches):
        if i == args.warmup:
            for m in (plain, ahead):
                m.cache.settle()  # a window planned in the background counts before the reset (reset_stats)
            before_reset = {mode: rows_moved(m) for mode, m in (("none", plain), ("prefetch", ahead))}
            plain.cache.reset_stats()
            ahead.cache.reset_stats()
            process_start = time.process_time()
        order = ("none", "prefetch") if i % 2 == 0 else ("prefetch", "none")
        for mode in order:
            step(mode, i, i >= args.warmup)
    process_cpu = time.process_time() - process_start
    it.close()  # the pipeline ends (its protection released) with batches left unread, as after a `break`
    none, pref = summary(plain, *times["none"]), summary(ahead, *times["prefetch"])
    counts = pipe.window_batches
    pref["window_batches"] = {str(k): counts.count(k) for k in sorted(set(counts))}
    record = {
        "cache_ratio": ratio, "cache_rows": ahead.cache.capacity, "depth": depth, "horizon": horizon,
        "steps": len(times["none"][0]), "none": none, "prefetch": pref,
        "prefetch_over_none": {k: round(pref[k] / none[k], 3) for k in ("step_ms", "step_ms_median", "thread_cpu_ms")},
        # the median over runs of `depth` consecutive steps (one window's admission each, where windows hold depth
        # batches) of prefetch time / plain time over the same batches, stepped back to back: a slow spell of
        # the shared box hits a few pairs, not the configuration's mean
        "paired_ratio_median": paired_ratio_median(times["prefetch"][0], times["none"][0], depth),
        # both modules' steps plus the read-ahead thread, per pair of steps
        "pair_process_cpu_ms": round(1000 * process_cpu / len(times["none"][0]), 2),
        "rows_moved_over_none": round(pref["rows_moved"] / max(1, none["rows_moved"]), 3),
        # every row moved host->device (or served from the host) since the modules were built, over batch-granular
        # Belady-OPT at the same cache rows: per batch for the plain module, over the pipeline's windows for prefetch
        "rows_moved_over_opt": opt_ratios(trace[:args.warmup + args.batches], ahead.cache.capacity, counts,
                                          {mode: before_reset.get(mode, 0) + rows_moved(m)
                                           for mode, m in (("none", plain), ("prefetch", ahead))}),
        "tables_equal": bool(torch.equal(plain.weight.detach(), ahead.weight.detach())),
    }
    del plain, ahead, pipe, it
    gc.collect()
    return record


def launch_counts(args) -> dict:
    """Device launches per steady-state step (cachedemb/tools/launch_count.py: sync-free sizing, Triton backend,
    counted without running the kernels), without prefetch and with each depth/horizon. Counted in a child
    process: Triton's CPU interpreter must be switched on before triton is imported."""
    configs = [None] + [[d, h] for d in args.depths for h in args.horizons if h >= d]
    code = ("import json, sys; from cachedemb.tools.launch_count import measure_step; "
            "out = [measure_step(bags=%d, prefetch=None if c is None else tuple(c), steps=8, warmup=4, "
            "execute=False) for c in json.loads(sys.argv[1])]; "
            "print(json.dumps([{k: r[k] for k in ('launches', 'host_pipeline_ops', 'prefetch', 'bags', "
            "'num_rows', 'cache_rows') if k in r} for r in out]))" % args.launch_bags)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(configs)], env=env, capture_output=True,
                          text=True, check=True)
    return {"config": "one table, fused Adagrad, sync-free sizing, Triton backend, validate_inputs=False, "
                      f"200k rows, 4k-row cache, {args.launch_bags} x 26 lookups",
            "per_step": json.loads(done.stdout.strip().splitlines()[-1])}


def git_hash() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rows", type=int, default=8_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--bags", type=int, default=4096)
    p.add_argument("--bag-len", type=int, default=26)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.05])
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--horizons", type=int, nargs="+", default=[16, 64])
    p.add_argument("--warmup", type=int, default=30, help="batches before timing (the caches fill)")
    p.add_argument("--batches", type=int, default=40, help="timed batches")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--trace-cache", help=".npy file keeping the generated batches between runs")
    p.add_argument("--launch-bags", type=int, default=64, help="bags per step of the launch count (0: skip it)")
    p.add_argument("--machine", default="", help="a note on the machine, kept in the JSON")
    p.add_argument("--load-note", default="", help="a note on the machine's load while it ran, kept in the JSON")
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    trace = load_trace(args)
    started = time.time()
    load_before = os.getloadavg()
    results = []
    for ratio in args.ratios:
        for depth in args.depths:
            for horizon in args.horizons:
                if horizon < depth:
                    continue
                record = run_pair(trace, args, ratio, depth, horizon)
                results.append(record)
                print(json.dumps({k: record[k] for k in ("cache_ratio", "depth", "horizon", "prefetch_over_none",
                                                         "paired_ratio_median", "rows_moved_over_opt",
                                                         "tables_equal")}), flush=True)
    report = {
        "benchmark": "prefetch_step_cpu",
        "command": "python " + " ".join([os.path.relpath(__file__)] + list(argv if argv is not None else sys.argv[1:])),
        "git": git_hash(),
        "machine": {"note": args.machine, "platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "load": {"note": args.load_note, "loadavg_before": [round(x, 2) for x in load_before],
                 "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                 "seconds": round(time.time() - started, 1)},
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "machine", "load_note")},
        "method": "per configuration, two modules with the same init step the same batches alternately (which "
                  "goes first alternates): one plain, one through cachedemb.prefetch; step_ms = wall time per "
                  "step after --warmup batches, thread_cpu_ms = the training thread's CPU time",
        "runs": results,
    }
    if args.launch_bags:
        report["launches"] = launch_counts(args)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return report


if __name__ == "__main__":
    main()
