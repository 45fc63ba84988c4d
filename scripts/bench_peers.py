#!/usr/bin/env python
"""cachedemb against its peers, one process: the same batches, the same initial table, the same SGD step.

Peers (each an adapter in peer_adapters.py beside this file; one that cannot run here says why in the JSON):

- `nn_embedding_bag`: the whole table in device memory, `nn.EmbeddingBag(sparse=True)` + `torch.optim.SGD`; its
  final table is the reference every cached table is compared with;
- `colossalai`: ColossalAI's `CachedEmbeddingBag` (LFU eviction, pinned host table) + `torch.optim.SGD` on its
  cache parameter;
- `fbgemm_uvm_caching`: FBGEMM's `SplitTableBatchedEmbeddingBagsCodegen` with `EmbeddingLocation.MANAGED_CACHING`
  (the kernel torchrec's `EmbeddingComputeKernel.FUSED_UVM_CACHING` builds), exact SGD fused into backward, its
  default LRU cache, the host table host-mapped;
- `cachedemb`, `cachedemb_prefetch`: `cachedemb.CachedEmbeddingBag` with fused `cachedemb.optim.SGD`, without and
  through `cachedemb.prefetch(depth, horizon)`.

All cached peers get the same cache ratio. A step is forward, loss `0.5 * ||out||^2 / batch` (its gradient
depends on the rows' values, so a stale or lost row changes the result), backward and the update. The batches
are Zipf(alpha) ids with hot ids scattered (`cachedemb.tools.traces.zipf_trace(..., permute=True)`), staged on
the device before timing, as a pipelined loader would provide them. Per peer: median step time, samples/s,
device memory (peak `torch.cuda.max_memory_allocated` over what was allocated before the peer was built), hit rate
(distinct ids found in the cache / distinct ids, per batch, over the timed steps), rows moved host->device (where
the peer exposes it), and the final table against the in-memory one (max abs difference, rows differing).

    python scripts/bench_peers.py --out benchmarks/results/gpu/peers.json             # 20M rows, 1% cache (GPU)
    python scripts/bench_peers.py --small --out benchmarks/results/peers_cpu_small.json  # CPU-sized
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from cachedemb.tools.traces import zipf_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peer_adapters.py beside this file, however it is run
# The adapters are re-exported: callers of main(peers=...) build their list from them.
from peer_adapters import (  # noqa: E402, F401
    CachedembPeer, ColossalAIPeer, FbgemmPeer, InMemoryPeer, Peer, PeerUnavailable, default_peers, version)

#: max |cached - in-memory| allowed for "matches" (float32 tables of N(0,1) rows; the peers sum an id's
#: gradients in different orders, so equal training agrees to rounding, far below this).
TABLE_ATOL = 1e-4


@dataclasses.dataclass(frozen=True)
class Config:
    rows: int = 20_000_000
    dim: int = 64
    batch: int = 16384
    pooling: int = 26
    alpha: float = 1.05
    cache_ratio: float = 0.01
    warmup: int = 5
    steps: int = 20
    lr: float = 0.01
    seed: int = 0
    depth: int = 4
    horizon: int = 64
    validate: bool = False

    def __post_init__(self):
        for name in ("rows", "dim", "batch", "pooling", "steps", "depth", "horizon"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not 0 < self.cache_ratio <= 1:
            raise ValueError(f"--cache-ratio must be in (0, 1], got {self.cache_ratio}")


#: --small: CPU-sized. A 5% cache, so that (as the 20M-row, 1% shape's 200k-row cache holds a batch's ~135k
#: distinct ids) the 10k-row cache holds a batch's ~8.7k.
SMALL = dict(rows=200_000, batch=1024, cache_ratio=0.05, warmup=3, steps=12)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare_tables(table: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 20) -> dict:
    """Max |table - ref| and the rows differing by more than TABLE_ATOL, in row chunks (no full-size temp)."""
    if table.shape != ref.shape:
        return {"matches_reference": False, "reason": f"shape {tuple(table.shape)} vs {tuple(ref.shape)}"}
    worst, rows_off, equal = 0.0, 0, True
    for lo in range(0, ref.shape[0], chunk):
        a, b = table[lo:lo + chunk].float(), ref[lo:lo + chunk].float()
        diff = (a - b).abs()
        if diff.numel():
            worst = max(worst, float(diff.max()))
            rows_off += int((diff > TABLE_ATOL).any(dim=1).sum())
        equal = equal and torch.equal(a, b)
    return {"max_abs_diff": worst, "rows_differing": rows_off, "bit_equal": equal, "tolerance": TABLE_ATOL,
            "matches_reference": worst <= TABLE_ATOL}


def run_peer(peer: Peer, init, batches, offsets, cfg: Config, device: torch.device) -> tuple[dict, object]:
    """Build, warm up, time and read back one peer; returns (its JSON record, its final table or None)."""
    rec = {"name": peer.name, "label": peer.label, "cached": peer.cached}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        t_build = time.perf_counter()
        peer.build(init, cfg, device)
        sync(device)
        rec["build_s"] = time.perf_counter() - t_build
        times, before = [], {}
        source = iter(peer.iterate(batches))
        t0 = None
        for i in range(cfg.warmup + cfg.steps):
            if i == cfg.warmup:
                sync(device)
                before = peer.counters()
                t0 = time.perf_counter()
            ids = next(source)
            peer.step(ids, offsets)
            if i >= cfg.warmup:
                sync(device)
                t1 = time.perf_counter()
                times.append(t1 - t0)
                t0 = t1
        after = peer.counters()
        rec.update(_timing(times, cfg.batch))
        if device.type == "cuda":
            rec["device_memory_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
            rec["device_memory_held_bytes"] = torch.cuda.memory_allocated(device) - base
        else:
            rec["device_memory_peak_bytes"] = None
            rec["device_memory_note"] = "CPU run: no device memory counter"
        rec.update(_cache_figures(before, after, cfg.steps, peer.cached))
        rec.update(peer.info())
        table = peer.table()
        rec["status"] = "ok"
    except PeerUnavailable as e:
        rec.update(status="unavailable", reason=str(e))
        table = None
    except Exception as e:  # noqa: BLE001 - a peer that breaks is reported, the others still run
        rec.update(status="failed", reason=f"{type(e).__name__}: {e}")
        table = None
    for attr in ("emb", "opt"):
        if hasattr(peer, attr):
            delattr(peer, attr)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec, table


def _timing(times: list[float], batch: int) -> dict:
    median = statistics.median(times)
    return {"step_s_median": median, "step_s_min": min(times), "step_s_max": max(times),
            "samples_per_s": batch / median, "timed_steps": len(times)}


def _cache_figures(before: dict, after: dict, steps: int, cached: bool) -> dict:
    if not cached:
        return {"hit_rate": None, "rows_in": 0, "rows_in_note": "the table is in device memory"}
    delta = {k: (after[k] - before.get(k, 0)) if after.get(k) is not None else None for k in after}
    out = {"hit_rate": None, "rows_in": delta.get("rows_in"), "host_reads": delta.get("host_reads")}
    if delta.get("unique"):
        out["hit_rate"] = delta["hits"] / delta["unique"]
        out["unique_per_step"] = delta["unique"] / steps
    if delta.get("rows_in") is not None:
        out["rows_in_per_step"] = delta["rows_in"] / steps
    if not after:
        out["counters_note"] = "the peer exposes no cache counters"
    return out


def summarize(records: list[dict], device: torch.device) -> dict:
    """The issue's goals where both sides ran: >= 2x ColossalAI's samples/s at <= its device memory; the cached
    step <= 1.3x the in-memory one (GPU); prefetch <= 0.7x no prefetch (GPU). None: a side did not run."""
    ok = {r["name"]: r for r in records if r.get("status") == "ok"}

    def ratio(a, b, key):
        if a in ok and b in ok and ok[a].get(key) and ok[b].get(key):
            return ok[a][key] / ok[b][key]
        return None

    out = {}
    for name in ("cachedemb", "cachedemb_prefetch"):
        out[f"{name}_over_colossalai_samples_per_s"] = ratio(name, "colossalai", "samples_per_s")
        out[f"{name}_over_colossalai_device_memory"] = ratio(name, "colossalai", "device_memory_peak_bytes")
        out[f"{name}_over_fbgemm_samples_per_s"] = ratio(name, "fbgemm_uvm_caching", "samples_per_s")
        out[f"{name}_over_in_memory_step"] = ratio(name, "nn_embedding_bag", "step_s_median")
    out["prefetch_over_no_prefetch_step"] = ratio("cachedemb_prefetch", "cachedemb", "step_s_median")
    best = [n for n in ("cachedemb", "cachedemb_prefetch") if n in ok]
    goals = {}
    if "colossalai" in ok and best:
        speed = max(out[f"{n}_over_colossalai_samples_per_s"] for n in best)
        mem = [out[f"{n}_over_colossalai_device_memory"] for n in best]
        goals["samples_per_s_ge_2x_colossalai"] = speed >= 2.0
        goals["device_memory_le_colossalai"] = None if None in mem else max(mem) <= 1.0
    else:
        goals["samples_per_s_ge_2x_colossalai"] = None
        goals["device_memory_le_colossalai"] = None
    if device.type == "cuda" and out["cachedemb_prefetch_over_in_memory_step"] is not None:
        goals["prefetch_step_le_1.3x_in_memory"] = out["cachedemb_prefetch_over_in_memory_step"] <= 1.3
    if device.type == "cuda" and out["prefetch_over_no_prefetch_step"] is not None:
        goals["prefetch_le_0.7x_no_prefetch"] = out["prefetch_over_no_prefetch_step"] <= 0.7
    out["goals"] = goals
    return out


def plot(report: dict, path: str) -> None:
    """Three panels, one bar per peer: samples/s (cached tables marked by their check against the in-memory
    one), device memory peak, rows moved host->device per step (hit rate on top)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = report["peers"]
    colors = ["tab:gray" if not r.get("cached", True) else "tab:blue" if r["name"].startswith("cachedemb")
              else "tab:orange" for r in recs]
    panels = [
        ("samples/s", lambda r: r.get("samples_per_s"), _speed_note),
        ("device memory peak (MiB)",
         lambda r: None if r.get("device_memory_peak_bytes") is None else r["device_memory_peak_bytes"] / 2**20,
         lambda r, v: f"{v:,.0f}"),
        ("rows moved host->device per step", lambda r: r.get("rows_in_per_step", 0 if not r.get("cached") else None),
         lambda r, v: f"{v:,.0f}" + (f"\nhit {r['hit_rate']:.2f}" if r.get("hit_rate") is not None else "")),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.8))
    for ax, (title, value, note) in zip(axes, panels):
        values = [value(r) if r.get("status") == "ok" else None for r in recs]
        bars = ax.bar(range(len(recs)), [v or 0 for v in values], color=colors)
        ax.set_xticks(range(len(recs)), [r["name"] for r in recs], rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.margins(y=0.2)
        if all(v is None for v in values):
            ax.set_yticks([])
        for bar, r, v in zip(bars, recs, values):
            text = r.get("status", "?") if r.get("status") != "ok" else "n/a" if v is None else note(r, v)
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=7)
    c = report["config"]
    fig.suptitle(f"{c['rows']:,} rows x {c['dim']}, {c['batch']} x {c['pooling']} Zipf({c['alpha']}) ids, "
                 f"cache {c['cache_ratio']:.0%}, SGD; {report['machine']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _speed_note(r: dict, v: float) -> str:
    text = f"{v:,.0f}"
    check = r.get("table_check", {})
    if r.get("cached"):
        text += "\n" + ("table ok" if check.get("matches_reference") else "TABLE DIFFERS")
    return text


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help=f"CPU-sized defaults: {SMALL}")
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", default=None)
        else:
            p.add_argument(flag, type=type(f.default), default=None, help=f"default {f.default}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--peers", nargs="+", metavar="NAME", help="run only these (default: all)")
    p.add_argument("--machine", help="a description of the machine, recorded in the JSON")
    p.add_argument("--out", help="write the JSON here (also printed)")
    p.add_argument("--png", help="bar chart path (default: --out with .png)")
    return p.parse_args(argv)


def main(argv=None, peers: list[Peer] | None = None) -> dict:
    args = parse_args(argv)
    values = {**(SMALL if args.small else {}),
              **{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
                 if getattr(args, f.name) is not None}}
    cfg = Config(**values)
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    peers = default_peers() if peers is None else peers
    if args.peers:
        known = {p.name for p in peers}
        unknown = sorted(set(args.peers) - known)
        if unknown:
            raise SystemExit(f"--peers: unknown {unknown}; expected some of {sorted(known)}")
        peers = [p for p in peers if p.name in args.peers]

    trace = zipf_trace(cfg.rows, cfg.batch * cfg.pooling, cfg.warmup + cfg.steps, cfg.alpha, seed=cfg.seed,
                       permute=True)
    distinct = statistics.mean(len(np.unique(b)) for b in trace)
    batches = [torch.from_numpy(b).to(device) for b in trace]
    offsets = (torch.arange(cfg.batch + 1, dtype=torch.int64) * cfg.pooling).to(device)
    # nn.EmbeddingBag's init (N(0, 1)), drawn once and copied into every peer.
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    gen = torch.Generator(device=gen_device).manual_seed(cfg.seed)
    init = torch.randn(cfg.rows, cfg.dim, generator=gen, device=gen_device).cpu()

    records, reference = [], None
    for peer in peers:
        rec, table = run_peer(peer, init, batches, offsets, cfg, device)
        if not peer.cached and table is not None and reference is None:
            reference = table
            rec["table_check"] = {"role": "reference"}
        elif table is not None:
            rec["table_check"] = compare_tables(table, reference) if reference is not None else \
                {"matches_reference": None, "reason": "no in-memory reference ran"}
        del table
        records.append(rec)
        print(json.dumps({k: rec.get(k) for k in ("name", "status", "reason", "step_s_median", "hit_rate")
                          if k in rec}), file=sys.stderr, flush=True)

    report = {
        "benchmark": "peers",
        "machine": {"description": args.machine, "platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
        "versions": {"torch": torch.__version__, "cachedemb": version("cachedemb"),
                     "colossalai": version("colossalai"),
                     "fbgemm_gpu": version("fbgemm-gpu") or version("fbgemm-gpu-cpu")},
        "config": {**dataclasses.asdict(cfg), "device": str(device), "small": args.small,
                   "loss": "0.5 * ||out||^2 / batch", "ids": f"staged on {device} before timing",
                   "distinct_ids_per_batch": distinct},
        "peers": records,
    }
    report["summary"] = summarize(records, device)
    png = args.png or (str(Path(args.out).with_suffix(".png")) if args.out else None)
    if png:
        try:
            plot(report, png)
            report["png"] = png
        except ImportError as e:
            report["png"] = None
            report["png_reason"] = f"matplotlib not available: {e}"
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
