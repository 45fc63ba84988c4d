"""Where a steady-state CachedEmbeddingBag training step spends its time, read with torch.profiler.

Runs the benchmark step of bench_embedding_bag.py (Zipf batches, SGD, sum pooling) for `--warmup` steps, then
profiles `--steps` steps and prints one JSON object: the wall time a step, the host-side runtime calls a step
(kernel launches, copies, synchronizations: a host sync shows as cudaStreamSynchronize / cudaEventSynchronize /
a blocking cudaMemcpy), and the kernels and host ops that take the most time, per step.

    python scripts/profile_step.py --rows 20000000 --prefetch 0 4 --out /tmp/profile.json
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

import cachedemb
from cachedemb.tools.traces import zipf_trace

RUNTIME_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                 "cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync", "cudaStreamSynchronize",
                 "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaStreamWaitEvent", "cudaEventRecord",
                 "cudaEventQuery", "cudaHostAlloc", "cudaMalloc", "cudaFree")


def profile_one(args, depth, device):
    lookups = args.batch * args.pooling
    n = args.warmup + args.steps
    batches = [torch.from_numpy(b).to(torch.int64) for b in zipf_trace(args.rows, lookups, n, args.alpha, seed=0)]
    offsets = torch.arange(args.batch, dtype=torch.int64, device=device) * args.pooling
    size = dict(cache_ratio=args.cache_ratio) if args.cache_rows is None else dict(cache_rows=args.cache_rows)
    model = cachedemb.CachedEmbeddingBag(args.rows, args.dim, mode="sum", **size, device=device,
                                         optimizer=cachedemb.optim.SGD(lr=0.01), validate_inputs=False)
    source = cachedemb.prefetch(batches, [model], depth=depth, horizon=max(depth, 16)) if depth else batches
    it = iter(source)
    for _ in range(args.warmup):
        model(next(it).to(device, non_blocking=True), offsets).sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            model(next(it).to(device, non_blocking=True), offsets).sum().backward()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
    for _ in it:  # let the pipeline end cleanly
        pass
    if args.trace:  # every thread's ops and runtime calls and the kernels, for chrome://tracing or Perfetto
        prof.export_chrome_trace(f"{args.trace}.prefetch{depth}.json")
    kernels = collections.Counter()
    kernel_calls = collections.Counter()
    host = collections.Counter()
    calls = collections.Counter()
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "cuda_time_total", 0)
        if e.key in RUNTIME_CALLS:
            calls[e.key] += e.count
            host["runtime:" + e.key] += e.self_cpu_time_total
        elif e.self_cpu_time_total > 0:
            host[e.key] += e.self_cpu_time_total
        if dev_us and e.self_cpu_time_total == 0:
            kernels[e.key] += dev_us
            kernel_calls[e.key] += e.count
    per = args.steps
    return {
        "prefetch_depth": depth,
        "step_ms": wall * 1e3,
        "hit_rate": model.cache_stats()["hits"] / max(1, model.cache_stats()["unique"]),
        "runtime_calls_per_step": {k: v / per for k, v in sorted(calls.items())},
        "device_ms_per_step": sum(kernels.values()) / per / 1e3,
        "top_kernels_ms_per_step": [[k, round(v / per / 1e3, 4), kernel_calls[k] / per]
                                    for k, v in kernels.most_common(args.top)],
        "top_host_ms_per_step": [[k, round(v / per / 1e3, 4)] for k, v in host.most_common(args.top)],
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=20_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=16384)
    p.add_argument("--pooling", type=int, default=26)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--cache-ratio", type=float, default=0.01)
    p.add_argument("--cache-rows", type=int, default=None)
    p.add_argument("--prefetch", type=int, nargs="+", default=[0, 4], metavar="K")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", metavar="PREFIX", help="also write each run's Chrome trace to PREFIX.prefetch<K>.json")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("profile_step.py reads CUDA kernel times: it needs a CUDA device")
    runs = [profile_one(args, depth, torch.device("cuda")) for depth in args.prefetch]
    out = {"benchmark": "profile_step", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "config": vars(args), "runs": runs}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
