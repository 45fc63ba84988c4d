"""Predict a training step's GPU time from what a CPU run records, with constants from GPU microbenchmarks only.

The model (docs/gpu_model.md): a step is a list of events in issue order (launches, copies, row moves, host
reads, waits between streams). The host issues them one after another, each launch costing `launch_us` of host
time; a device op starts on its stream when it has been issued and the stream's previous op is done, and takes
its bytes over the rate of its kind; a pageable host->device copy and a host read block the host until the device
has done them; the benchmark synchronizes after each step, so a step ends when the host and every stream are done.
A row move runs on the stream that issued it: serial with compute unless the record puts it on a side stream.

Constants come ONLY from the microbenchmark JSON (`--kernels`, bench_kernels.py's output): the copy engine's
pinned rate, the zero-copy rate of a row-copy kernel, kernel rates per op, and the host cost of a launch (the
gated full ranking's time, which does no work, over its launches). `--row-move` adds bench_kernels --row-move's
measured constants where a GPU run has written them (pageable copy rate, launch costs, row-move rates).

A prefetched step also has the read-ahead thread (docs/gpu_model.md): at abfc35d the host read-ahead, whose
next-use query of a window starts after the previous window's admission and which the next admission waits for;
its rates come from host work measured on a CPU (the read-ahead's own stage timers on the GPU machine's host,
or scripts/host_read_ahead_bench.py here), never from the step times. A record names the read-ahead a CUDA cache
gets (the device one at this tree: no host id work on the critical path).

Three steps are modelled:
- `in_memory`: nn.EmbeddingBag(sparse=True) + torch.optim.SGD with the table in GPU memory;
- `no_prefetch`, `prefetch`: CachedEmbeddingBag, from a record: `--record` (cachedemb/tools/step_record.py's
  JSON, scaled to the bench shape) or, for the calibration at abfc35d, the counts of a profile JSON
  (`--profile`: runtime calls per step) and the step JSON's hit rate (`--step`).

    python scripts/gpu_model.py                      # the abfc35d calibration: predicted vs measured
    python scripts/gpu_model.py --record rec.json    # the current tree, from its CPU record
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_RESULTS = ROOT / "benchmarks" / "results" / "gpu"
DEFAULT_KERNELS = GPU_RESULTS / "kernels_h200_99809bc.json"
DEFAULT_PROFILE = GPU_RESULTS / "profile_step_h200_abfc35d.json"
DEFAULT_STEPS = (GPU_RESULTS / "embedding_bag_step_h200_abfc35d.json",
                 GPU_RESULTS / "embedding_bag_step_prefetch_h200_abfc35d.json")
HOST_READ_AHEAD_BENCH = ROOT / "benchmarks" / "results" / "host_read_ahead_cpu.json"
GATED_RANKING_LAUNCHES = 30  # launches of bench_kernels' full_ranking_gate_closed (counted: step_record on CPU)
NO_RUNTIME_CALL = ("empty", "empty_strided", "empty_like")  # allocations (any overload): no launch
TOLERANCE = 0.20


# ----------------------------------------------------------------------------------------------- constants
@dataclass
class Constants:
    """Rates in bytes/s, costs in seconds; `source` says where each came from."""

    pinned_h2d: float
    zero_copy: float  # host bytes per second a row-copy kernel reads over the link
    pageable_h2d: float
    launch_s: float
    sync_s: float
    kernel_rate: dict = field(default_factory=dict)  # op -> bytes/s
    kernel_time: dict = field(default_factory=dict)  # op -> s (ops timed at this very shape)
    source: dict = field(default_factory=dict)


def load_constants(kernels_path, row_move_path=None) -> Constants:
    """Constants from bench_kernels.py's JSON (and its --row-move JSON where given)."""
    d = json.loads(Path(kernels_path).read_text())
    meta, res = d["meta"], {(r["op"], r["impl"]): r for r in d["results"] if "median_ms" in r}
    dim, elem = meta["dim"], 4
    zc = res[("row_copy_h2d_zero_copy", "triton")]
    rows = zc["bytes"] // (2 * dim * elem + 16)  # bench_kernels: bytes = m * (2 D e + 16)
    zero_copy = rows * dim * elem / (zc["median_ms"] / 1e3)
    staged = res[("row_copy_h2d_staged", "staged")]
    gated = res[("full_ranking_gate_closed", "triton")]
    c = Constants(
        pinned_h2d=meta["pinned_h2d_memcpy_GBps"] * 1e9,
        zero_copy=zero_copy,
        # a pageable copy is a host memcpy into a pinned staging buffer plus the DMA: the staged row copy (host
        # gather into a pinned buffer, then the copy) is the nearest measured path
        pageable_h2d=rows * dim * elem / (staged["median_ms"] / 1e3),
        launch_s=gated["median_ms"] / 1e3 / GATED_RANKING_LAUNCHES,
        sync_s=gated["median_ms"] / 1e3 / GATED_RANKING_LAUNCHES,
        kernel_rate={op: res[(op, impl)]["GBps"] * 1e9 for op, impl in
                     (("pooled_forward", "triton"), ("backward_update", "triton"), ("slot_lookup", "triton"),
                      ("slot_score", "triton"))},
        source={"kernels": str(Path(kernels_path).name),
                "zero_copy": "row_copy_h2d_zero_copy (triton): host bytes / median",
                "pageable_h2d": "row_copy_h2d_staged: host bytes / median (no pageable copy was measured)",
                "launch_s": f"full_ranking_gate_closed median / {GATED_RANKING_LAUNCHES} launches",
                "sync_s": "one launch's host cost (no sync was measured)"},
    )
    c.kernel_rate["pooled_forward_torch"] = res[("pooled_forward", "torch")]["GBps"] * 1e9
    # the other kernels are priced by their tensor arguments' bytes (buffers of the batch or the cache; the tables
    # excluded) at the streaming rate the forward reached: most read a part of their buffers, so this bounds them
    c.kernel_rate["other"] = c.kernel_rate["pooled_forward"]
    c.kernel_time["unique_ids"] = res[("unique_ids", "triton")]["median_ms"] / 1e3 / meta["n_lookups"]  # per lookup
    c.kernel_time["sort_torch"] = res[("unique_ids", "torch")]["median_ms"] / 1e3 / meta["n_lookups"]
    if row_move_path is not None:
        rm = json.loads(Path(row_move_path).read_text())
        k = rm.get("constants") or {}
        if k:
            c.pageable_h2d = k["pageable_h2d_GBps"] * 1e9
            c.launch_s = (k["triton_launch_host_us"] + k["aten_launch_host_us"]) / 2 / 1e6
            c.sync_s = k["synchronize_host_us"] / 1e6
            c.source.update(pageable_h2d=f"{Path(row_move_path).name}: pageable_h2d_GBps",
                            launch_s="mean of the measured Triton and aten launch host costs",
                            sync_s="measured synchronize host cost")
    return c


# ----------------------------------------------------------------------------------------------- timeline
def simulate(events: list[dict], c: Constants) -> dict:
    """Run the events through the host / stream timeline. Event kinds: launch (bytes, rate or seconds),
    row_move (in_bytes, out_bytes: over the link), copy (bytes, pinned), host_read, wait (stream waits for
    another's last op), mark (a named point: the host's time and its stream's clock there, from the step's start,
    in `marks`). Returns the step time and its breakdown."""
    host, steps, steps_start, marks = 0.0, 0, 0.0, []
    clock = {"compute": 0.0, "side": 0.0, "read_ahead": 0.0}  # read_ahead: the device read-ahead thread's stream
    busy = {"compute": 0.0, "side": 0.0, "read_ahead": 0.0}
    parts = {"launch_host_s": 0.0, "blocking_copy_s": 0.0, "host_wait_s": 0.0, "row_move_s": 0.0, "kernels_s": 0.0,
             "copies_s": 0.0}
    for e in events:
        kind, stream = e["kind"], e.get("stream", "compute")
        if stream not in clock:  # host-only threads issue no device work
            continue
        if kind == "wait":
            clock[stream] = max(clock[stream], clock[e["on"]])
            continue
        if kind == "mark":  # a point of the step others wait on: the host's time and the stream's there
            marks.append({"name": e["name"], "host_s": host - steps_start, "device_s": clock[stream] - steps_start})
            continue
        if kind == "step_end":  # the benchmark's synchronize: every stream, then the next step
            host = max([host] + list(clock.values())) + c.sync_s
            steps, steps_start = steps + 1, host
            continue
        if kind == "host_read":
            host += c.sync_s
            done = max(clock.values())
            parts["host_wait_s"] += max(0.0, done - host)
            host = max(host, done)
            continue
        if e.get("runtime_call", True):
            host += c.launch_s
            parts["launch_host_s"] += c.launch_s
        if kind == "row_move":
            t = (e["in_bytes"] + e["out_bytes"]) / c.zero_copy
            parts["row_move_s"] += t
        elif kind == "copy":
            t = e["bytes"] / (c.pinned_h2d if e.get("pinned") else c.pageable_h2d)
            parts["copies_s"] += t
        else:
            t = e.get("seconds", 0.0) + e.get("bytes", 0) / c.kernel_rate.get(e.get("rate", "other"),
                                                                            c.kernel_rate["other"])
            parts["kernels_s"] += t
        start = max(host, clock[stream])
        clock[stream] = start + t
        busy[stream] += t
        if kind == "copy" and not e.get("pinned"):  # pageable: the host waits for the copy
            parts["blocking_copy_s"] += clock[stream] - host
            host = clock[stream]
    end = max([host] + list(clock.values()))
    if events and events[-1]["kind"] != "step_end":  # the benchmark synchronizes after each step
        end, steps = end + c.sync_s, steps + 1
    n = max(1, steps)  # per step, over the events' steps
    return {"step_ms": end / n * 1e3, "steps": n, "host_ms": host / n * 1e3, "marks": marks,
            "device_busy_ms": {k: v / n * 1e3 for k, v in busy.items()},
            **{k.replace("_s", "_ms"): v / n * 1e3 for k, v in parts.items()}}


# ----------------------------------------------------------------------------------------------- steps
@dataclass
class Shape:
    rows: int = 20_000_000
    dim: int = 64
    batch: int = 16384
    pooling: int = 26
    elem: int = 4

    @property
    def lookups(self) -> int:
        return self.batch * self.pooling


def forward_bytes(s: Shape) -> float:
    """bench_kernels' pooled_forward traffic: ids, slots and a row per lookup, the pooled output."""
    return s.lookups * (8 + 8 + s.dim * s.elem) + s.batch * s.dim * s.elem + (s.batch + 1) * 8


def backward_bytes(s: Shape, unique: float, states: int = 0) -> float:
    """bench_kernels' backward_update traffic (its Adagrad formula with `states` per-row states)."""
    return s.lookups * (s.dim * 4 + 8 + 8 + 8 + 4) + unique * (8 + 8 + 2 * s.dim * s.elem + 2 * states * s.dim * 4)


def caller_copies(s: Shape) -> list[dict]:
    """The benchmark's `ids.to(device, non_blocking=True)` and `offsets.to(device)`: from pageable memory."""
    return [{"kind": "copy", "bytes": s.lookups * 8, "pinned": False, "name": "ids"},
            {"kind": "copy", "bytes": s.batch * 8, "pinned": False, "name": "offsets"}]


def in_memory_ops() -> list[str]:
    """The aten ops of one nn.EmbeddingBag(sparse=True) + SGD step (zero_grad, forward, sum, backward, step),
    recorded on CPU in issue order (views and profiler markers dropped): the reference step's launches. Each is
    priced as one launch: the kernels a composite op runs inside it on CUDA are not visible on CPU."""
    import torch
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if not func.is_view and not name.startswith("_record_function"):
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    ref = nn.EmbeddingBag(1000, 8, mode="sum", sparse=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    ids, offsets = torch.randint(0, 1000, (64,)), torch.arange(0, 64, 4)
    for _ in range(2):  # the second step: the gradient buffer exists
        with Ops() as mode:
            opt.zero_grad()
            ref(ids, offsets).sum().backward()
            opt.step()
    return mode.ops


def in_memory_events(s: Shape, unique: float, ops: list[str] | None = None) -> list[dict]:
    """nn.EmbeddingBag(sparse=True) + SGD from its recorded ops: the forward (embedding_bag), the sparse gradient
    (a row per lookup written), its copy, and the optimizer's add_ of a sparse gradient (coalesce: a sort of the
    lookups and their rows summed per id; then the distinct rows added into the table)."""
    row = s.dim * s.elem
    ev = caller_copies(s)
    for op in ops if ops is not None else in_memory_ops():
        if op == "_embedding_bag":
            ev.append({"kind": "launch", "name": op, "bytes": forward_bytes(s), "rate": "pooled_forward_torch"})
        elif op == "_embedding_bag_backward":
            ev.append({"kind": "launch", "name": op, "bytes": s.batch * row + s.lookups * (row + 8),
                       "rate": "pooled_forward_torch"})
        elif op == "clone":  # the sparse gradient's values
            ev.append({"kind": "launch", "name": op, "bytes": 2 * s.lookups * row, "rate": "pooled_forward_torch"})
        elif op == "add_":
            ev.append({"kind": "launch", "name": op, "seconds": s.lookups * CONST_SORT_PER_LOOKUP[0],
                       "bytes": s.lookups * row + 4 * unique * row, "rate": "pooled_forward_torch"})
        elif op in ("sum", "ones_like"):
            ev.append({"kind": "launch", "name": op, "bytes": s.batch * row, "rate": "pooled_forward_torch"})
        else:
            ev.append({"kind": "launch", "name": op, "runtime_call": op.split(".")[0] not in NO_RUNTIME_CALL})
    return ev


CONST_SORT_PER_LOOKUP = [0.0]  # set from the constants (the torch unique_ids time per lookup) before use


def cached_events_from_profile(s: Shape, profile_run: dict, unique: float, hit_rate: float,
                               before_move: int, prefetch: bool = False) -> list[dict]:
    """A CachedEmbeddingBag step at abfc35d from its profile's counts: runtime calls per step (launches,
    memsets, copies), `before_move` of them issued before the row move, the row move's rows (misses in, as many
    dirty victims out), forward and backward at their microbenchmark rates. Host reads: the synchronizations the
    profile counts (event syncs: the host waits for the device). With `prefetch`: the event syncs are the host
    read-ahead thread's (it waits for the slot snapshot's copy before its next-use query), not the training
    thread's, and a `snapshot` mark follows the window's admission (its row move): the query starts there."""
    calls = profile_run["runtime_calls_per_step"]
    launches = calls.get("cuLaunchKernelEx", 0) + calls.get("cudaLaunchKernel", 0) + calls.get("cudaMemsetAsync", 0)
    copies = calls.get("cudaMemcpyAsync", 0)
    syncs = calls.get("cudaEventSynchronize", 0)
    misses = unique * (1 - hit_rate)
    moves = profile_run.get("window_rows_per_step", misses)
    row = s.dim * s.elem
    small = launches - 3  # the row move, forward and backward are priced by their bytes
    ev = caller_copies(s)
    ev += [{"kind": "copy", "bytes": 8, "pinned": True, "name": "small"} for _ in range(max(0, round(copies) - 2))]
    head = max(0, before_move - len(ev))
    lookup_bytes = s.lookups * 8 * 4  # ids sorted, unique, inverse, slots: O(lookups) buffers per small kernel
    per_small = lookup_bytes / max(1, small)
    ev += [{"kind": "launch", "name": "small", "bytes": per_small} for _ in range(min(head, round(small)))]
    ev.append({"kind": "launch", "name": "unique_ids", "seconds": s.lookups * CONST_UNIQUE_PER_LOOKUP[0],
               "runtime_call": False})
    for _ in range(0 if prefetch else round(syncs)):
        ev.append({"kind": "host_read", "name": "event_synchronize"})
    ev.append({"kind": "row_move", "in_bytes": moves * row, "out_bytes": moves * row})
    if prefetch:
        ev.append({"kind": "mark", "name": "snapshot"})
    ev.append({"kind": "launch", "name": "pooled_forward", "bytes": forward_bytes(s), "rate": "pooled_forward"})
    ev.append({"kind": "launch", "name": "backward_update", "bytes": backward_bytes(s, unique),
               "rate": "backward_update"})
    ev += [{"kind": "launch", "name": "small", "bytes": per_small} for _ in range(max(0, round(small) - head))]
    return ev


CONST_UNIQUE_PER_LOOKUP = [0.0]


def cached_events_from_record(s: Shape, record: dict, unique: float, hit_rate: float) -> list[dict]:
    """A step from a CPU record (cachedemb/tools/step_record.py) carried to `s`: its launches in order and on their
    streams, argument bytes scaled with the lookups, row moves with the misses (split in and out as recorded)."""
    from cachedemb.tools.step_record import scale_record

    misses = unique * (1 - hit_rate)
    rec = scale_record(record, s.lookups, misses, dirty_out=misses)
    row = s.dim * s.elem
    span = rec.get("event_steps", 1)
    moves = [e for e in rec["events"] if e["kind"] == "row_move"]
    n_in = sum(e.get("direction") in ("in", "both") for e in moves)
    n_out = sum(e.get("direction") in ("out", "both") for e in moves)
    rows_in, rows_out = misses * span, rec["rows_out_per_step"] * span  # the events' steps share these
    ev = []
    for e in rec["events"]:
        base = {"name": e["name"], "stream": e["stream"],
                "runtime_call": not (e["engine"] == "aten" and e["name"].split(".")[0] in NO_RUNTIME_CALL)}
        if e["kind"] == "step_end":
            ev.append({**base, "kind": "step_end"})
        elif e["kind"] == "row_move":
            d = e.get("direction", "both")
            ev.append({**base, "kind": "row_move",
                       "in_bytes": rows_in * row / n_in if d in ("in", "both") else 0.0,
                       "out_bytes": rows_out * row / n_out if d in ("out", "both") else 0.0})
        elif e["name"] == "pooled_forward_kernel":
            ev.append({**base, "kind": "launch", "bytes": forward_bytes(s), "rate": "pooled_forward"})
        elif e["name"] == "backward_update_kernel":
            ev.append({**base, "kind": "launch", "bytes": backward_bytes(s, unique), "rate": "backward_update"})
        elif e["name"] in ("sort", "sort.stable", "sort.default"):
            ev.append({**base, "kind": "launch", "seconds": s.lookups * CONST_UNIQUE_PER_LOOKUP[0]})
        else:
            ev.append({**base, "kind": "launch", "bytes": e["bytes"] if base["runtime_call"] else 0})
    reads = [{"kind": "host_read", "name": name} for name, n in rec.get("host_reads_per_step", {}).items()
             for _ in range(round(n))]
    steps, cur = [], []
    for e in ev:  # each step: the caller's copies first, the host reads before its end
        if e["kind"] == "step_end":
            steps.append(caller_copies(s) + cur + reads + [e])
            cur = []
        else:
            cur.append(e)
    if cur or not steps:
        steps.append(caller_copies(s) + cur + reads)
    return [e for st in steps for e in st]


# ----------------------------------------------------------------------------------------------- read-ahead
@dataclass
class HostReadAhead:
    """The host read-ahead thread's work (ReadAhead): thread seconds per lookup entered (a batch's sort, the
    next-use tracker, the window plan) and per slot id of a window's next-use query. `query_waits_snapshot`: the
    query's seconds include the thread's (spinning) wait for the slot snapshot's copy, which a run on a GPU
    measures and a CPU run has not."""

    enter_s_per_lookup: float
    query_s_per_slot: float
    query_waits_snapshot: bool
    batches_per_window: float
    source: str


def load_host_bench(path=HOST_READ_AHEAD_BENCH, tree: str = "abfc35d", lookups: int | None = None) -> dict:
    """One measurement of host_read_ahead_bench.py's JSON: the tree's run at `lookups` (else its largest)."""
    d = json.loads(Path(path).read_text())
    trees = [m for m in d["measurements"] if m["tree"]["label"] == tree]
    if not trees:
        raise ValueError(f"{path}: no measurement of tree {tree!r} (have "
                         f"{[m['tree']['label'] for m in d['measurements']]})")
    runs = trees[0]["runs"]
    run = next((r for r in runs if r["shape"]["lookups"] == lookups), max(runs, key=lambda r: r["shape"]["lookups"]))
    return {"run": run, "tree": trees[0]["tree"], "machine": trees[0]["machine"]}


def host_read_ahead_from_bench(path=HOST_READ_AHEAD_BENCH, tree: str = "abfc35d",
                               lookups: int | None = None) -> HostReadAhead:
    """The host read-ahead's rates as host_read_ahead_bench.py measured them on a CPU (no device: the query's
    seconds are its own work)."""
    m = load_host_bench(path, tree, lookups)
    r = m["run"]
    return HostReadAhead(r["enter_ns_per_lookup"] * 1e-9, r["query_ns_per_slot_id"] * 1e-9, False,
                         r["batches_per_window"],
                         f"{Path(path).name}: tree {tree}, {m['machine']['processor']} "
                         f"({m['machine']['cpu_threads']} threads), {r['shape']['lookups']} lookups a batch")


def host_read_ahead_from_stage_timers(step_json, s: Shape, batches_per_window: float) -> HostReadAhead:
    """The host read-ahead's rates on the GPU machine's host, from the read-ahead thread's own stage timers in a
    run there (bench_embedding_bag.py's `cache_seconds`: thread time of prefetch_unique, prefetch_next_use,
    prefetch_window_plan, prefetch_next_use_query): host work measured on that host's CPU, not the step times.
    Every batch of the trace is entered once; one query per window (`batches_per_window`, from the CPU
    microbenchmark at this shape)."""
    d = json.loads(Path(step_json).read_text())
    run, cfg = d["runs"][0], d["config"]
    sec = run["cache_seconds"]
    batches = cfg["warmup"] + cfg["steps"]
    windows = batches / batches_per_window
    enter = sum(sec[k] for k in ("prefetch_unique", "prefetch_next_use", "prefetch_window_plan"))
    return HostReadAhead(enter / batches / s.lookups, sec["prefetch_next_use_query"] / windows / run["cache_rows"],
                         True, batches_per_window,
                         f"{Path(step_json).name}: cache_seconds (read-ahead thread time on {d['machine']['device']}'s "
                         f"host) over {batches} batches, {windows:g} windows")


def with_host_read_ahead(train: dict, ra: HostReadAhead, s: Shape, cache_rows: int, trace_batches: int | None,
                         depth: int) -> dict:
    """The prefetched step with the host read-ahead thread as a resource: the training thread's step `train`
    (simulated), the query chain (a window's next-use query starts at the `snapshot` mark, after its admission,
    and the next window's admission waits for it) and the thread's whole work per step (enters + queries);
    the step is the largest. A trace no longer than the read-ahead distance (horizon + 2 depth) is entered in
    the first fill, before the first query: its timed steps see the queries only."""
    query = cache_rows * ra.query_s_per_slot
    horizon = max(depth, 16)  # bench_embedding_bag.py's prefetch
    front_loaded = trace_batches is not None and trace_batches <= horizon + 2 * depth + 1
    enter = 0.0 if front_loaded else s.lookups * ra.enter_s_per_lookup
    thread = enter + query / ra.batches_per_window
    snap = next((m for m in train["marks"] if m["name"] == "snapshot"), None)
    if snap is None:  # no admission point recorded: the query is not placed, only the thread's load counts
        chain = thread
    else:
        begin = snap["host_s"] if ra.query_waits_snapshot else max(snap["host_s"], snap["device_s"])
        chain = (begin + query) / ra.batches_per_window
    parts = {"training_thread_ms": train["step_ms"], "read_ahead_chain_ms": chain * 1e3,
             "read_ahead_thread_ms": thread * 1e3}
    bound = max(parts, key=parts.get)
    return {**train, "step_ms": parts[bound], "bound": bound.replace("_ms", ""),
            "read_ahead": {"kind": "host", **parts, "query_ms_per_window": query * 1e3,
                           "enter_ms_per_batch": s.lookups * ra.enter_s_per_lookup * 1e3,
                           "enters_before_timed_steps": front_loaded, "source": ra.source}}


def device_read_ahead_events(s: Shape, c: Constants) -> list[dict]:
    """The device read-ahead's work a batch (device_read_ahead.py): one sort of the batch's ids, priced at the
    torch sort time per lookup, on the read-ahead thread's own stream; its launches are that thread's host cost,
    not the training thread's. Its unions and next uses (binary searches into the sorted ids) are not priced."""
    return [{"kind": "launch", "name": "device_read_ahead_sort", "stream": "read_ahead", "runtime_call": False,
             "seconds": s.lookups * c.kernel_time["sort_torch"]}]


def read_ahead_kind(record: dict) -> str:
    """Which read-ahead the pipeline uses for a CUDA cache: the record's (step_record.read_ahead_kinds), else
    the pipeline's rule now."""
    kinds = record.get("read_ahead")
    if kinds:
        return kinds["cuda_cache"]
    from cachedemb.tools.step_record import read_ahead_kinds

    import torch

    return read_ahead_kinds(type("Cache", (), {"device": torch.device("cpu")})())["cuda_cache"]


# ----------------------------------------------------------------------------------------------- report
def predict(c: Constants, s: Shape, unique: float, hit_rate: float, profile: dict | None = None,
            record: dict | None = None, prefetch_record: dict | None = None, before_move: int = 84,
            host_read_ahead: HostReadAhead | None = None, cache_rows: int | None = None,
            trace_batches: int | None = None, depth: int = 4) -> dict:
    """Each step's timeline. A prefetched step at abfc35d (`profile`) ran the host read-ahead: with
    `host_read_ahead` given, its thread is a resource of the step (`with_host_read_ahead`). A prefetched step from
    a record runs the read-ahead the record names for a CUDA cache: the device one puts a sort a batch on its own
    stream; the host one (CACHEDEMB_READ_AHEAD=host) needs `host_read_ahead`."""
    CONST_SORT_PER_LOOKUP[0] = c.kernel_time["sort_torch"]
    CONST_UNIQUE_PER_LOOKUP[0] = c.kernel_time["unique_ids"]
    cache_rows = cache_rows if cache_rows is not None else round(0.01 * s.rows)
    out = {"in_memory": simulate(in_memory_events(s, unique), c)}
    if profile is not None:
        runs = {r["prefetch_depth"]: r for r in profile["runs"]}
        out["no_prefetch"] = simulate(cached_events_from_profile(s, runs[0], unique, hit_rate, before_move), c)
        if depth in runs:
            train = simulate(cached_events_from_profile(s, runs[depth], unique, hit_rate, before_move,
                                                        prefetch=host_read_ahead is not None), c)
            out["prefetch"] = (with_host_read_ahead(train, host_read_ahead, s, cache_rows, trace_batches, depth)
                               if host_read_ahead is not None else train)
    if record is not None:
        out["no_prefetch"] = simulate(cached_events_from_record(s, record, unique, hit_rate), c)
    if prefetch_record is not None:
        kind = read_ahead_kind(prefetch_record)
        ev = cached_events_from_record(s, prefetch_record, unique, hit_rate)
        if kind == "device":
            with_sorts = device_read_ahead_events(s, c)  # one a batch: at each step's start
            for e in ev:
                with_sorts.append(e)
                if e["kind"] == "step_end" and e is not ev[-1]:
                    with_sorts += device_read_ahead_events(s, c)
            ev = with_sorts
            out["prefetch"] = {**simulate(ev, c), "read_ahead": {
                "kind": "device", "on_critical_path": False,
                "why": "the record's pipeline rule puts a CUDA cache's read-ahead on the device "
                       "(device_read_ahead.py): no host id work a batch; its sort runs on its own stream"}}
        elif host_read_ahead is None:
            raise ValueError("the record's read-ahead for a CUDA cache is 'host': give host_read_ahead")
        else:
            out["prefetch"] = with_host_read_ahead(simulate(ev, c), host_read_ahead, s, cache_rows, trace_batches,
                                                   depth)
    ref = out["in_memory"]["step_ms"]
    for v in out.values():
        v["ratio_to_in_memory"] = v["step_ms"] / ref
    return out


def ratios(pred: dict) -> dict:
    """The ratios the bar is stated in: prefetch and no prefetch over in memory, prefetch over no prefetch."""
    out = {f"{k}/in_memory": pred[k]["step_ms"] / pred["in_memory"]["step_ms"] for k in ("prefetch", "no_prefetch")
           if k in pred}
    if "prefetch" in pred and "no_prefetch" in pred:
        out["prefetch/no_prefetch"] = pred["prefetch"]["step_ms"] / pred["no_prefetch"]["step_ms"]
    return out


def measured_abfc35d(steps=DEFAULT_STEPS) -> dict:
    plain, pre = (json.loads(Path(p).read_text())["runs"][0] for p in steps)
    return {"in_memory": plain["reference_step_s"] * 1e3, "no_prefetch": plain["cached_step_s"] * 1e3,
            "prefetch": pre["cached_step_s"] * 1e3, "hit_rate": plain["hit_rate"],
            "unique_per_batch": plain["unique_per_batch"]}


def prefetch_inputs(steps=DEFAULT_STEPS) -> dict:
    """The prefetch run's configuration (inputs): depth, batches in its trace, cache rows."""
    d = json.loads(Path(steps[1]).read_text())
    return {"depth": d["config"]["prefetch"], "trace_batches": d["config"]["warmup"] + d["config"]["steps"],
            "cache_rows": d["runs"][0]["cache_rows"]}


def calibration(kernels=DEFAULT_KERNELS, profile=DEFAULT_PROFILE, steps=DEFAULT_STEPS,
                host_bench=HOST_READ_AHEAD_BENCH) -> dict:
    """The abfc35d steps predicted from its profile's counts and the microbenchmarks' constants, beside what was
    measured; `within` per step: |predicted / measured - 1| <= TOLERANCE. The prefetch step's host read-ahead is
    priced by its stage timers on the H200's host (`host_read_ahead_from_stage_timers`); the same step priced
    with this CPU's microbenchmark rates (host_read_ahead_bench.py, abfc35d's code) is given beside it."""
    c = load_constants(kernels)
    m = measured_abfc35d(steps)
    s = Shape()
    pin = prefetch_inputs(steps)
    bench = host_read_ahead_from_bench(host_bench, "abfc35d", s.lookups)
    ra = host_read_ahead_from_stage_timers(steps[1], s, bench.batches_per_window)
    prof = json.loads(Path(profile).read_text())
    args = dict(profile=prof, cache_rows=pin["cache_rows"], trace_batches=pin["trace_batches"], depth=pin["depth"])
    pred = predict(c, s, m["unique_per_batch"], m["hit_rate"], host_read_ahead=ra, **args)
    rows = {}
    for k, v in pred.items():
        err = v["step_ms"] / m[k] - 1
        rows[k] = {"predicted_ms": v["step_ms"], "measured_ms": m[k], "error": err,
                   "within": abs(err) <= TOLERANCE, "breakdown": v}
    this_cpu = predict(c, s, m["unique_per_batch"], m["hit_rate"], host_read_ahead=bench, **args)["prefetch"]
    return {"constants": vars(c), "host_read_ahead": vars(ra),
            "measured_inputs": {"hit_rate": m["hit_rate"], "unique_per_batch": m["unique_per_batch"], **pin},
            "steps": rows,
            "prefetch_at_this_cpus_rates": {"predicted_ms": this_cpu["step_ms"],
                                            "error": this_cpu["step_ms"] / m["prefetch"] - 1,
                                            "host_read_ahead": vars(bench), "read_ahead": this_cpu["read_ahead"]}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default=str(DEFAULT_KERNELS), help="bench_kernels.py JSON (the constants)")
    p.add_argument("--row-move", help="bench_kernels.py --row-move JSON: measured copy / launch constants")
    p.add_argument("--profile", default=str(DEFAULT_PROFILE), help="profile_step.py JSON (counts, for abfc35d)")
    p.add_argument("--steps", nargs=2, default=[str(x) for x in DEFAULT_STEPS], metavar=("PLAIN", "PREFETCH"),
                   help="bench_embedding_bag.py JSONs: measured steps (compared) and hit rate (an input)")
    p.add_argument("--record", help="step_record JSON (no prefetch) of the tree to predict")
    p.add_argument("--prefetch-record", help="step_record JSON with prefetch")
    p.add_argument("--host-read-ahead", default=str(HOST_READ_AHEAD_BENCH),
                   help="host_read_ahead_bench.py JSON (the host read-ahead's rates on a CPU)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    for path in [args.kernels, args.profile, args.host_read_ahead, *args.steps] + [
            x for x in (args.record, args.prefetch_record, args.row_move) if x]:
        if not Path(path).is_file():
            p.error(f"{path}: no such file (expected a JSON written by the scripts named in --help)")
    report = {"tree": git_tree(),
              "calibration_abfc35d": calibration(args.kernels, args.profile, args.steps, args.host_read_ahead)}
    if args.record:
        c = load_constants(args.kernels, args.row_move)
        m = measured_abfc35d(args.steps)
        rec = json.loads(Path(args.record).read_text())
        pre = json.loads(Path(args.prefetch_record).read_text()) if args.prefetch_record else None
        host = None
        if pre is not None and read_ahead_kind(pre) == "host":  # CACHEDEMB_READ_AHEAD=host: this tree's rates
            host = host_read_ahead_from_bench(args.host_read_ahead, "current", Shape().lookups)
        pin = prefetch_inputs(args.steps)
        pred = predict(c, Shape(), m["unique_per_batch"], m["hit_rate"], record=rec, prefetch_record=pre,
                       host_read_ahead=host, cache_rows=pin["cache_rows"], trace_batches=pin["trace_batches"],
                       depth=pin["depth"])
        report["current_tree"] = {**pred, "ratios": ratios(pred),
                                  "records": [Path(x).name for x in (args.record, args.prefetch_record) if x]}
    text = json.dumps(report, indent=1, default=float)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


def git_tree() -> dict:
    """The commit this ran at, and whether the tree had changes beside it."""
    import subprocess

    def git(*a):
        try:
            return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(status) if status is not None else None}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
