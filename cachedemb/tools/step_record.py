"""What a training step issues, recorded on CPU: the input of scripts/gpu_model.py.

A step of the benchmark's configuration (one table, fused SGD, sum pooling, `validate_inputs=False`) runs under
CACHEDEMB_SYNC_FREE=1 with the Triton backend under TRITON_INTERPRET=1, the CUDA code path's launch sequence,
without executing the kernels (launch_count's `execute=False`: valid where no host decision reads a device value).
Every device-facing event is recorded in issue order:

- `launch`: a Triton kernel or a non-view aten op the library issues (attributed as launch_count does), with
  the thread that issued it (the training thread is the compute stream; the window-copy thread a side stream,
  where a CUDA cache moves a window's rows) and the bytes of its tensor arguments (the tables, counts and
  cache rows excluded: a kernel touches only the rows it is given indices for);
- `row_move`: a launch of a row-move kernel, with the rows it moves in and out (taken from the cache's own
  counters, `rows_in` / `rows_out`, after the step);
- `host_read`: a read of a tensor value (`.item()`, `.tolist()`, `int()`, `bool()`) by the cache or the
  kernels on the training thread: a sync on a GPU (the pipeline's reads of host ids and the reads of landed
  pinned buffers, HOST_BUFFER_SITES, are not).

`record_step` returns per-step averages plus the ordered events of the last step (with prefetch: of the last
window, a `step_end` after each step: the benchmark synchronizes there); `scale_record` carries a
record to a larger shape: launches flat, rows moved with the misses, argument bytes with the lookups.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cachedemb.tools.launch_count import _environment, _kernel_classes, _library_site, zipf_batches

ROW_MOVE_KERNELS = ("row_stream_kernel", "row_move_kernel", "row_copy_many_kernel", "row_copy_kernel")
HOST_READS = ("item", "tolist", "__int__", "__bool__")
# reads of host memory on every device (no sync there): the miss counts landed in a pinned buffer
HOST_BUFFER_SITES = ("cachedemb/cache/miss_estimate.py:_fold",)


@dataclass
class StepEvents:
    events: list = field(default_factory=list)
    host_reads: collections.Counter = field(default_factory=collections.Counter)


def _tensor_bytes(args, kwargs, exclude: set[int]) -> int:
    total = 0
    for a in list(args) + list((kwargs or {}).values()):
        if torch.is_tensor(a) and a.untyped_storage().data_ptr() not in exclude:
            total += a.numel() * a.element_size()
    return total


def _stream() -> str:
    name = threading.current_thread().name
    if threading.current_thread() is threading.main_thread():
        return "compute"
    return "side" if "window-copy" in name else "host"


class StepRecorder:
    """Records launches (Triton and aten), row moves and host reads while `active`, without running kernels."""

    def __init__(self, exclude_storages=(), host_table: int | None = None):
        self.host_table = host_table  # storage of the host table: a row move reading it moves rows in
        self.active = False
        self.in_kernel = 0
        self.exclude = {int(p) for p in exclude_storages}
        self.step = StepEvents()
        self._stack = contextlib.ExitStack()
        self._lock = threading.Lock()

    def _add(self, event: dict) -> None:
        with self._lock:
            self.step.events.append(event)

    def _direction(self, name: str, args) -> str:
        """in / out for a split row move (its first source is the host table or not), both for the fused one."""
        if name == "row_move_kernel":
            return "both"
        src = next((a for a in args if torch.is_tensor(a) and a.dim() == 2), None)
        return "in" if src is not None and src.untyped_storage().data_ptr() == self.host_table else "out"

    def __enter__(self) -> "StepRecorder":
        recorder = self

        class _Aten(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if recorder.active and recorder.in_kernel == 0 and not func.is_view:
                    where = _library_site()
                    if where is not None and where[0] == "launches":
                        recorder._add({"kind": "launch", "engine": "aten", "name": func.__name__,
                                       "stream": _stream(), "bytes": _tensor_bytes(args, kwargs, recorder.exclude)})
                return out

        for cls in _kernel_classes():
            attr = "__call__" if cls.__name__ == "GridExecutor" else "run"
            real = getattr(cls, attr)

            def run(fn, *args, _real=real, **kwargs):
                if recorder.active and recorder.in_kernel == 0:
                    name = fn.fn.__name__
                    event = {"kind": "launch", "engine": "triton", "name": name, "stream": _stream(),
                             "bytes": _tensor_bytes(args, kwargs, recorder.exclude)}
                    if name in ROW_MOVE_KERNELS:
                        event.update(kind="row_move", direction=recorder._direction(name, args))
                    recorder._add(event)
                return None  # never executed: the sync-free launch sequence does not depend on values

            setattr(cls, attr, run)
            self._stack.callback(setattr, cls, attr, real)
        for name in HOST_READS:
            real = getattr(torch.Tensor, name)

            def read(t, *a, _real=real, _name=name, **k):
                if recorder.active and _stream() == "compute":
                    where = _library_site(2)
                    if where is not None and where[0] == "launches" and where[1] not in HOST_BUFFER_SITES:
                        recorder.step.host_reads[_name] += 1
                return _real(t, *a, **k)

            setattr(torch.Tensor, name, read)
            self._stack.callback(setattr, torch.Tensor, name, real)
        self._stack.enter_context(_Aten())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def record_step(bags: int = 64, bag_len: int = 26, num_rows: int = 200_000, cache_rows: int = 4000, dim: int = 64,
                prefetch: int = 0, warmup: int = 4, steps: int = 4, seed: int = 0) -> dict:
    """Record steady-state steps of the benchmark's step (forward, `out.sum().backward()`, fused SGD) on CPU;
    with `prefetch` = depth, through `cachedemb.prefetch(depth, horizon=max(depth, 16))` and over whole windows.
    Needs TRITON_INTERPRET=1 set before triton is imported. The rows moved come from a second run of the same
    batches on the torch backend (executed: the cache's rows_in / rows_out counters)."""
    import cachedemb
    from cachedemb import optim

    if prefetch:
        warmup, steps = -(-warmup // prefetch) * prefetch, -(-steps // prefetch) * prefetch
    horizon = max(prefetch, 16)
    extra = horizon + 2 * prefetch + 1 if prefetch else 0
    batches = zipf_batches(warmup + steps + extra, num_rows, bags, bag_len, seed)

    def build():
        torch.manual_seed(seed)
        return cachedemb.CachedEmbeddingBag(num_rows, dim, mode="sum", cache_rows=cache_rows,
                                            optimizer=optim.SGD(lr=0.01), device="cpu", validate_inputs=False)

    def source(emb):
        return iter(cachedemb.prefetch(batches, [emb], depth=prefetch, horizon=horizon) if prefetch else batches)

    env = {"CACHEDEMB_BACKEND": "triton", "CACHEDEMB_SYNC_FREE": "1"}
    with _environment(**env):
        emb = build()
        tables = [emb.cache.host_weight, emb.cache.rows, emb.cache.host_freq, emb.cache.slot_freq] + list(
            emb.cache.host_states.values()) + list(emb.cache.states.values())  # read at given rows only
        exclude = {t.untyped_storage().data_ptr() for t in tables}
        it = source(emb)
        per_step = []
        with StepRecorder(exclude, emb.cache.host_weight.untyped_storage().data_ptr()) as rec:
            for step in range(warmup + steps):
                rec.step = StepEvents()
                rec.active = step >= warmup
                ids, offsets = next(it)
                emb(ids, offsets).sum().backward()
                rec.active = False
                if step >= warmup:
                    per_step.append(rec.step)
            if prefetch:
                it.close()
    # the counts a GPU run's kernels would produce, from an executed run of the same batches (torch backend)
    with _environment(CACHEDEMB_BACKEND="torch", CACHEDEMB_SYNC_FREE="1"):
        ref = build()
        it = source(ref)
        for step in range(warmup + steps):
            if step == warmup:
                before = dict(ref.cache_stats())
            ids, offsets = next(it)
            ref(ids, offsets).sum().backward()
        after = ref.cache_stats()
        if prefetch:
            it.close()
    moved = {k: (after[k] - before[k]) / steps for k in ("rows_in", "rows_out", "unique", "hits", "lookups")}
    out = summarize(per_step, moved, dict(bags=bags, bag_len=bag_len, num_rows=num_rows, cache_rows=cache_rows,
                                          dim=dim, prefetch=prefetch, steps=steps))
    if prefetch:
        out["read_ahead"] = read_ahead_kinds(emb.cache)
    return out


def read_ahead_kinds(cache) -> dict:
    """Which read-ahead the pipeline runs (its own rule, pipeline.read_ahead_on_device): for the recorded cache
    and for the same cache on a CUDA device (the GPU step the record predicts): 'host' (ReadAhead, the id work on
    a host thread) or 'device' (DeviceReadAhead)."""
    from types import SimpleNamespace

    from cachedemb.prefetch.pipeline import read_ahead_on_device

    def kind(device):
        return "device" if read_ahead_on_device([SimpleNamespace(device=device)]) else "host"

    return {"recorded": kind(cache.device), "cuda_cache": kind(torch.device("cuda", 0))}


def summarize(per_step: list[StepEvents], moved: dict, shape: dict) -> dict:
    """Per-step averages: launches per stream and engine, argument bytes, row-move launches, host reads; the
    ordered events of the last recorded step (the model's timeline) with the row moves' rows attached."""
    n = len(per_step)
    launches = collections.Counter()
    arg_bytes = collections.Counter()
    reads = collections.Counter()
    for s in per_step:
        for e in s.events:
            launches[f"{e['stream']}:{e['engine']}"] += 1
            arg_bytes[e["stream"]] += e["bytes"]
        reads.update(s.host_reads)
    span = max(1, shape.get("prefetch") or 1)  # a whole window: its admission happens once in it
    last = []
    for s in per_step[-span:]:
        last += s.events + [{"kind": "step_end", "engine": "", "name": "synchronize", "stream": "compute",
                             "bytes": 0}]
    move_launches = sum(e["kind"] == "row_move" for s in per_step for e in s.events) / max(1, n)
    row_bytes = shape["dim"] * 4
    return {
        "shape": shape,
        "launches_per_step": {k: v / n for k, v in sorted(launches.items())},
        "argument_bytes_per_step": {k: v / n for k, v in sorted(arg_bytes.items())},
        "host_reads_per_step": {k: v / n for k, v in sorted(reads.items())},
        "row_move_launches_per_step": move_launches,
        "rows_in_per_step": moved["rows_in"], "rows_out_per_step": moved["rows_out"],
        "unique_per_step": moved["unique"], "hits_per_step": moved["hits"], "lookups_per_step": moved["lookups"],
        "row_bytes": row_bytes,
        "event_steps": span,
        "events": [{k: e[k] for k in ("kind", "engine", "name", "stream", "bytes", "direction") if k in e}
                   for e in last],
    }


def scale_record(record: dict, lookups: float, misses: float, dirty_out: float | None = None) -> dict:
    """The record carried to a shape with `lookups` lookups and `misses` rows in a step (and `dirty_out` rows out,
    default: in the recorded out/in ratio): launches unchanged, argument bytes times the lookups' ratio, rows
    moved set to the given counts."""
    ratio = lookups / max(1.0, record["lookups_per_step"])
    out_ratio = record["rows_out_per_step"] / max(1.0, record["rows_in_per_step"])
    scaled = dict(record)
    scaled["events"] = [dict(e, bytes=e["bytes"] * ratio) for e in record["events"]]
    scaled["argument_bytes_per_step"] = {k: v * ratio for k, v in record["argument_bytes_per_step"].items()}
    scaled["rows_in_per_step"] = misses
    scaled["rows_out_per_step"] = misses * out_ratio if dirty_out is None else dirty_out
    scaled["lookups_per_step"] = lookups
    scaled["scaled_from"] = {"lookups": record["lookups_per_step"], "rows_in": record["rows_in_per_step"],
                             "lookup_ratio": ratio}
    return scaled


def main(argv=None) -> dict:
    import argparse
    import json
    import os

    p = argparse.ArgumentParser(description="Record a training step's launches, row moves and host reads on CPU "
                                            "(needs TRITON_INTERPRET=1): the input of scripts/gpu_model.py")
    p.add_argument("--bags", type=int, default=64)
    p.add_argument("--bag-len", type=int, default=26)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--cache-rows", type=int, default=1000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--prefetch", type=int, default=0, metavar="DEPTH")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        p.error("the Triton launches are recorded under the CPU interpreter: set TRITON_INTERPRET=1")
    for name in ("bags", "bag_len", "rows", "cache_rows", "dim", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    rec = record_step(args.bags, args.bag_len, args.rows, args.cache_rows, args.dim, args.prefetch, args.warmup,
                      args.steps)
    text = json.dumps(rec, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return rec


if __name__ == "__main__":
    main()
