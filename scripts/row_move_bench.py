"""The row-move microbenchmark behind `bench_kernels.py --row-move`: an admission's row moves alone, against the
copy engine on the same bytes, and the constants scripts/gpu_model.py reads.

For 256 B and 512 B rows (fp32, dim 64 / 128) and both kinds of page-locked host table (registered with
cudaHostRegister as cachedemb/cache/host_memory.py does, or allocated by cudaHostAlloc through torch's
pin_memory), each row-move variant of kernels/row_copy.py (split: out and in launches; fused: one launch) moves
`--move-rows` scattered rows in (host -> cache slots, with their counts), out (dirty victims -> host) and both
(out, then in: what an admission does). Beside each, the copy engine moves the same bytes as one contiguous
cudaMemcpyAsync per direction (both: one on each of two streams). Rates are bytes of rows per direction per
second (the 8-byte counts are not counted as traffic).

`constants`: pinned and pageable host->device copy rates, the host time of a pageable copy, of one Triton
launch, one aten launch and one synchronize: what a step's model needs besides kernel rates.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch

from cachedemb.cache.host_memory import host_empty

DIRECTIONS = ("in", "out", "both")
ROW_DIMS = (64, 128)  # fp32: 256 B and 512 B rows


def _module():
    import importlib

    return importlib.import_module("cachedemb.kernels.row_copy")


VARIANTS = {"split": "row_move_split_triton", "fused": "row_move_fused_triton"}


class Timer:
    def __init__(self, cuda: bool, reps: int):
        self.cuda, self.reps = cuda, reps

    def median_s(self, fn) -> float:
        fn()
        if not self.cuda:
            times = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def host_table(rows: int, dim: int, kind: str, cuda: bool) -> torch.Tensor:
    """A host table of `kind`: 'registered' (cudaHostRegister), 'pinned' (cudaHostAlloc), 'cpu' (no CUDA)."""
    if kind == "registered":
        t = host_empty((rows, dim), torch.float32, pinned=cuda)
    elif kind == "pinned":
        t = torch.empty(rows, dim, pin_memory=True)
    else:
        t = torch.empty(rows, dim)
    t.normal_()
    return t


def admission(n: int, host_rows: int, cache_rows: int, device, gen):
    """n victims (distinct slots, every one dirty) and n misses (distinct host ids, none a victim's), rank r's
    miss into victim r's slot, in random host order (scattered like a Zipf batch's misses)."""
    perm = torch.randperm(host_rows, generator=gen)
    victims = torch.randperm(cache_rows, generator=gen)[:n]
    old = perm[:n]
    miss = perm[n:2 * n]
    return {k: v.to(device) for k, v in dict(victims=victims, old_ids=old, dirty_ids=old.clone(), miss_ids=miss,
                                              miss_dest=victims.clone()).items()}


def move_call(fn, pairs, slot_freq, host_freq, move, direction: str, n: int, device):
    n_admit = torch.tensor([n if direction in ("out", "both") else 0], device=device)
    n_miss = torch.tensor([n if direction in ("in", "both") else 0], device=device)
    return lambda: fn(pairs, slot_freq, host_freq, move["victims"], n_admit, move["old_ids"], move["dirty_ids"],
                      move["miss_ids"], move["miss_dest"], n_miss, None)


def copy_engine_call(host_flat, dev_flat, nbytes: int, direction: str):
    """Contiguous cudaMemcpyAsync of nbytes per direction; both: H2D on the current stream, D2H on a second."""
    h, d = host_flat[:nbytes], dev_flat[:nbytes]
    h2, d2 = host_flat[nbytes:2 * nbytes], dev_flat[nbytes:2 * nbytes]
    if direction == "in":
        return lambda: d.copy_(h, non_blocking=True)
    if direction == "out":
        return lambda: h.copy_(d, non_blocking=True)
    side = torch.cuda.Stream()

    def both():
        side.wait_stream(torch.cuda.current_stream())
        d.copy_(h, non_blocking=True)
        with torch.cuda.stream(side):
            h2.copy_(d2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    return both


def constants(timer: Timer) -> dict:
    """Copy rates and host costs of a step's non-kernel work, measured alone."""
    import triton
    import triton.language as tl

    @triton.jit
    def _empty_kernel(x):
        tl.store(x, 0)

    out = {}
    pinned = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    out["pinned_h2d_GBps"] = pinned.numel() / timer.median_s(lambda: dev.copy_(pinned, non_blocking=True)) / 1e9
    out["pinned_d2h_GBps"] = pinned.numel() / timer.median_s(lambda: pinned.copy_(dev, non_blocking=True)) / 1e9
    ids = torch.randint(0, 1 << 30, (16384 * 26,), dtype=torch.int64)  # a step's ids, pageable
    dev_ids = torch.empty_like(ids, device="cuda")
    out["pageable_h2d_bytes"] = ids.numel() * 8
    out["pageable_h2d_GBps"] = out["pageable_h2d_bytes"] / timer.median_s(
        lambda: dev_ids.copy_(ids, non_blocking=True)) / 1e9

    def host_us(fn, reps=200):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host = (time.perf_counter() - t0) / reps
        torch.cuda.synchronize()
        return host * 1e6

    out["pageable_h2d_host_us"] = host_us(lambda: dev_ids.copy_(ids, non_blocking=True), reps=20)
    x = torch.zeros(1, device="cuda")
    out["triton_launch_host_us"] = host_us(lambda: _empty_kernel[(1,)](x))
    out["aten_launch_host_us"] = host_us(lambda: x.add_(1))
    out["synchronize_host_us"] = host_us(torch.cuda.synchronize)
    return out


def run(args) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    timer = Timer(cuda, args.reps if cuda else 1)
    gen = torch.Generator().manual_seed(0)
    mod = _module()
    if cuda:
        n, host_rows, kinds = args.move_rows, args.host_rows, ("registered", "pinned")
    else:  # --smoke: the interpreter's sizes
        n, host_rows, kinds = 48, 400, ("cpu",)
    cache_rows = max(2 * n, int(args.cache_ratio * args.table_rows)) if cuda else 2 * n
    meta = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "smoke": not cuda, "move_rows": n, "host_rows": host_rows,
            "cache_rows": cache_rows, "row_move_mode_default": mod.row_move_mode()}
    results = []
    for dim in ROW_DIMS:
        row_bytes = dim * 4
        for kind in kinds:
            host = host_table(host_rows, dim, kind, cuda)
            host_freq = torch.randint(0, 1000, (host_rows,), generator=gen)
            host_freq = host_freq.pin_memory() if cuda else host_freq
            rows = torch.randn(cache_rows, dim, generator=gen).to(device)
            slot_freq = torch.randint(0, 1000, (cache_rows,), generator=gen).to(device)
            move = admission(n, host_rows, cache_rows, device, gen)
            pairs = [(rows, host)]
            nbytes = n * row_bytes
            dev_flat = torch.empty(2 * nbytes, dtype=torch.uint8, device=device) if cuda else None
            host_flat = host.view(-1).view(torch.uint8)
            for direction in DIRECTIONS:
                ce_s = timer.median_s(copy_engine_call(host_flat, dev_flat, nbytes, direction)) if cuda else None
                for variant, name in VARIANTS.items():
                    row = {"op": "row_move", "variant": variant, "direction": direction, "row_bytes": row_bytes,
                           "host_memory": kind, "rows": n, "bytes_per_direction": nbytes}
                    if not cuda:  # smoke: the variant equals the reference on this move
                        got = [(rows.clone(), host.clone()), slot_freq.clone(), host_freq.clone()]
                        ref = [(rows.clone(), host.clone()), slot_freq.clone(), host_freq.clone()]
                        move_call(getattr(mod, name), [got[0]], got[1], got[2], move, direction, n, device)()
                        move_call(mod.row_move_torch, [ref[0]], ref[1], ref[2], move, direction, n, device)()
                        row["equal_to_reference"] = all(torch.equal(a, b) for a, b in
                                                        zip(list(got[0]) + got[1:], list(ref[0]) + ref[1:]))
                    else:
                        t = timer.median_s(move_call(getattr(mod, name), pairs, slot_freq, host_freq, move,
                                                     direction, n, device))
                        row.update(median_ms=t * 1e3, GBps_per_direction=nbytes / t / 1e9,
                                   copy_engine_ms=ce_s * 1e3, copy_engine_GBps_per_direction=nbytes / ce_s / 1e9,
                                   fraction_of_copy_engine=ce_s / t)
                    results.append(row)
                    print(json.dumps(row), flush=True)
            del host, host_flat, rows, dev_flat
    report = {"meta": meta, "constants": constants(timer) if cuda else None, "results": results}
    if cuda:
        print(json.dumps({"constants": report["constants"]}), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report
