"""The host read-ahead's CPU cost per id: ReadAhead (cachedemb/prefetch/read_ahead.py) driven as the prefetch
pipeline drives it, on the caller's thread (threaded=False), CPU thread time per stage.

The pipeline hands the read-ahead every batch's ids (`submit_enter`: a stable sort, `NextUseTracker.enter`, the
windows that can be planned) and, once per window, a snapshot of the cache's slot ids whose next uses the next
window's admission needs (`submit_next_use`). This runs that sequence over a Zipf trace with no cache and no
model: the snapshot is the window's union filled up to the cache's rows with the trace's hottest ids of the last
batches (what an LFU cache at steady state holds, near enough for the cost of a query, which is per slot id).
`locate=False`: a CUDA cache takes no forward hand-off, so no `submit_unique` runs (the GPU case).

The figures are this machine's thread time; gpu_model.py uses them as the host read-ahead's cost a batch on the
GPU's host (docs/gpu_model.md says how). Run against another tree with PYTHONPATH=<its root>.

    python scripts/host_read_ahead_bench.py --out run.json
    python scripts/host_read_ahead_bench.py --merge benchmarks/results/host_read_ahead_cpu.json run.json ...
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch


def drive(rows: int, batch: int, pooling: int, alpha: float, cache_rows: int, depth: int, horizon: int,
          windows: int, warmup_windows: int, seed: int = 0) -> dict:
    """Thread seconds per stage over `windows` windows after `warmup_windows`, per batch and per id."""
    from cachedemb.prefetch.read_ahead import ReadAhead
    from cachedemb.tools.traces import zipf_trace

    lookups = batch * pooling
    read_ahead = horizon + 2 * depth  # the pipeline reads this far ahead of the batch it yields
    span = read_ahead + 2  # pipeline.SPAN_SLACK
    # enough batches for every window asked for, if windows are as deep as allowed or a batch each
    n_batches = read_ahead + 2 + (warmup_windows + windows) * depth
    trace = [torch.from_numpy(t).to(torch.int64) for t in zipf_trace(rows, lookups, n_batches, alpha, seed=seed)]
    ra = ReadAhead([cache_rows], depth, horizon, span=span, locate=False, threaded=False)
    entered = 0

    def enter_until(n):
        nonlocal entered
        while entered < min(n, len(trace)):
            ra.submit_enter(entered, [trace[entered].clone()]).result()
            entered += 1
        if entered == len(trace):
            ra.submit_end(len(trace)).result()

    def snapshot(info, start):
        union = info.unions[0] if info.count else torch.empty(0, dtype=torch.int64)
        recent = torch.cat(trace[max(0, start - span):start + 1])
        ids, counts = torch.unique(recent, return_counts=True)
        hot = ids[torch.argsort(counts, descending=True, stable=True)]
        hot = hot[~torch.isin(hot, union)][:max(0, cache_rows - union.numel())]
        return torch.cat([union, hot])[:cache_rows]

    start, done, measured_batches, measured_windows, slot_ids, measured_entered = 0, 0, 0, 0, 0, 0
    stage_totals: dict[str, float] = {}
    while done < warmup_windows + windows:
        entered_before = entered
        enter_until(start + read_ahead + 1)  # the pipeline's fill before it yields batch `start`
        info = ra.window_future(start).result()
        end = info.end
        if end + horizon > entered and entered == len(trace):
            break  # the trace ran out before this window's next uses could be asked
        enter_until(end + horizon)  # the next uses of the window at `end` read batches up to end + horizon
        snap = snapshot(info, start)  # not read-ahead work: the cache's slot ids, which the pipeline snapshots
        ra.submit_next_use(end, [(snap, None)]).result()
        seconds = ra.take_seconds()[0]
        if done >= warmup_windows:
            measured_batches += end - start
            measured_windows += 1
            measured_entered += entered - entered_before
            slot_ids += snap.numel()
            for k, v in seconds.items():
                stage_totals[k] = stage_totals.get(k, 0.0) + v
        start, done = end, done + 1
    ra.close()
    if not measured_batches:
        raise SystemExit("no window was measured: give more --windows or a shorter --horizon")
    enter_s = sum(stage_totals.get(k, 0.0) for k in ("prefetch_unique", "prefetch_next_use", "prefetch_window_plan"))
    query_s = stage_totals.get("prefetch_next_use_query", 0.0)
    # batches entered and batches yielded differ over a short run (the read-ahead runs ahead): enter work per
    # batch entered, query work per window over the batches the windows cover
    enter_per_batch = enter_s / max(1, measured_entered)
    per_batch = enter_per_batch + query_s / measured_batches
    return {
        "shape": {"rows": rows, "batch": batch, "pooling": pooling, "lookups": lookups, "alpha": alpha,
                  "cache_rows": cache_rows, "depth": depth, "horizon": horizon},
        "batches": measured_batches, "windows": measured_windows,
        "batches_per_window": measured_batches / measured_windows,
        "batches_entered": measured_entered,
        "stage_ms": {k: v * 1e3 for k, v in sorted(stage_totals.items())},
        "enter_ms_per_batch": enter_per_batch * 1e3,
        "query_ms_per_window": query_s / measured_windows * 1e3,
        "read_ahead_ms_per_batch": per_batch * 1e3,
        "enter_ns_per_lookup": enter_per_batch / lookups * 1e9,
        "query_ns_per_slot_id": query_s / max(1, slot_ids) * 1e9,
        "slot_ids_per_window": slot_ids / measured_windows,
    }


def tree_commit(path: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--pooling", type=int, default=26)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--cache-ratio", type=float, default=0.01)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--horizon", type=int, default=16)
    p.add_argument("--scale", type=float, nargs="+", default=[0.25, 1.0],
                   help="shapes run: rows and batch times each scale (per-id figures should not move)")
    p.add_argument("--windows", type=int, default=6, help="windows measured per shape")
    p.add_argument("--warmup-windows", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2,
                   help="runs per shape; the least-loaded (lowest thread time) is kept, all are listed")
    p.add_argument("--label", default="", help="which tree this ran (default 'current'; e.g. a commit run through "
                                               "PYTHONPATH), recorded")
    p.add_argument("--out")
    p.add_argument("--merge", nargs="+", metavar=("OUT", "RUN"),
                   help="write OUT with the runs' JSONs (of different trees) as its measurements, then stop")
    args = p.parse_args(argv)
    if args.merge:
        if len(args.merge) < 2:
            p.error("--merge OUT RUN [RUN ...]: give the output and at least one run's JSON")
        runs = [json.loads(Path(x).read_text()) for x in args.merge[1:]]
        bad = [x for x, r in zip(args.merge[1:], runs) if r.get("benchmark") != "host_read_ahead_cpu"]
        if bad:
            p.error(f"--merge: {bad} are not host_read_ahead_bench.py outputs")
        Path(args.merge[0]).write_text(json.dumps({"benchmark": "host_read_ahead_cpu", "measurements": runs},
                                                  indent=1) + "\n")
        return runs
    for name in ("rows", "batch", "pooling", "depth", "horizon", "windows", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: expected a positive integer")
    if not 0 < args.cache_ratio <= 1 or any(s <= 0 for s in args.scale):
        p.error(f"--cache-ratio {args.cache_ratio} / --scale {args.scale}: expected in (0, 1] / positive")
    torch.set_num_threads(1)  # the read-ahead is one thread
    import cachedemb

    try:
        from cachedemb import native_available
        native = bool(native_available())
    except ImportError:  # older trees compiled the helpers at run time
        from cachedemb.prefetch import host_map
        native = host_map.lib() is not None
    root = Path(cachedemb.__file__).resolve().parents[1]
    runs = []
    for s in args.scale:
        rows, batch = max(1, round(args.rows * s)), max(1, round(args.batch * s))
        tries = [drive(rows, batch, args.pooling, args.alpha, max(1, round(rows * args.cache_ratio)),
                       args.depth, args.horizon, args.windows, args.warmup_windows) for _ in range(args.repeat)]
        best = min(tries, key=lambda r: r["read_ahead_ms_per_batch"])
        runs.append({**best, "read_ahead_ms_per_batch_of_each_try": [r["read_ahead_ms_per_batch"] for r in tries]})
    out = {"benchmark": "host_read_ahead_cpu",
           "command": "python scripts/host_read_ahead_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "tree": {"label": args.label or "current", "commit": tree_commit(root), "cachedemb": str(root),
                    "native_helpers": native},
           "machine": {"platform": platform.platform(), "processor": _cpu_name(), "cpu_threads": os.cpu_count()},
           "torch": torch.__version__, "clock": "time.thread_time of the read-ahead's own stages", "runs": runs}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
