"""The peers scripts/bench_peers.py runs: one adapter per implementation, each driving it as its users do.

An adapter builds its module from a shared initial table (copying it), runs one training step (forward, the
loss, backward, the update), reads its cache counters where it has them, and hands back its full table after the
last step. One that cannot run here raises PeerUnavailable with the reason the JSON records.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path

import torch
from torch import nn

import cachedemb


class PeerUnavailable(Exception):
    """The peer cannot run here (not installed, needs CUDA, import error); the message says which."""


def loss_of(out: torch.Tensor, batch: int) -> torch.Tensor:
    """Its gradient is the pooled rows themselves: a stale or lost row changes every later update."""
    return 0.5 * out.pow(2).sum() / batch


class Peer:
    """One implementation under test. `build` copies `init` (never writes it; `cfg` is bench_peers.Config);
    `step` runs forward, loss, backward and the update; `counters` are cumulative (unique, hits, rows_in,
    host_reads; empty where the peer exposes none); `table` is the full table on the CPU after the last step."""

    name = "peer"
    label = "peer"
    cached = True

    def build(self, init: torch.Tensor, cfg, device: torch.device) -> None:
        raise NotImplementedError

    def iterate(self, batches):
        return batches

    def step(self, ids: torch.Tensor, offsets: torch.Tensor) -> None:
        raise NotImplementedError

    def counters(self) -> dict:
        return {}

    def info(self) -> dict:
        return {}

    def table(self) -> torch.Tensor:
        raise NotImplementedError


class InMemoryPeer(Peer):
    name, label, cached = "nn_embedding_bag", "nn.EmbeddingBag, table in device memory", False

    def __init__(self, lr_scale: float = 1.0):
        self.lr_scale = lr_scale  # tests use a wrong lr to check that a differing table is reported

    def build(self, init, cfg, device):
        self.batch = cfg.batch
        self.emb = nn.EmbeddingBag(cfg.rows, cfg.dim, mode="sum", sparse=True, _weight=init.to(device, copy=True))
        self.opt = torch.optim.SGD(self.emb.parameters(), lr=cfg.lr * self.lr_scale)

    def step(self, ids, offsets):
        self.opt.zero_grad(set_to_none=True)
        loss_of(self.emb(ids, offsets[:-1]), self.batch).backward()
        self.opt.step()

    def table(self):
        return self.emb.weight.detach().to("cpu", copy=True)


class CachedembPeer(Peer):
    def __init__(self, prefetch: bool, lr_scale: float = 1.0):
        self.prefetch = prefetch
        self.lr_scale = lr_scale
        self.name = "cachedemb_prefetch" if prefetch else "cachedemb"
        self.label = "cachedemb + prefetch" if prefetch else "cachedemb"

    def build(self, init, cfg, device):
        self.cfg, self.batch = cfg, cfg.batch
        # A private copy: on a CPU-only machine the module uses a contiguous host tensor in place.
        self.emb = cachedemb.CachedEmbeddingBag(cfg.rows, cfg.dim, mode="sum", cache_ratio=cfg.cache_ratio,
                                                optimizer=cachedemb.optim.SGD(lr=cfg.lr * self.lr_scale),
                                                device=device, validate_inputs=cfg.validate,
                                                _weight=init.clone())

    def iterate(self, batches):
        if not self.prefetch:
            return batches
        return cachedemb.prefetch(batches, [self.emb], depth=self.cfg.depth, horizon=self.cfg.horizon)

    def step(self, ids, offsets):
        loss_of(self.emb(ids, offsets[:-1]), self.batch).backward()

    def counters(self):
        s = self.emb.cache_stats()
        return {"unique": s["unique"], "hits": s["hits"], "rows_in": s["rows_in"], "host_reads": s["host_rows"]}

    def info(self):
        s = self.emb.cache_stats()
        info = {"cache_rows": int(self.emb.cache.capacity), "cache_device_bytes": int(s["device_bytes"]),
                "host_seconds": s["seconds"]}
        if self.prefetch:
            info.update(depth=self.cfg.depth, horizon=self.cfg.horizon, windows=s.get("windows"))
        return info

    def table(self):
        return self.emb.state_dict()["weight"].to("cpu", copy=True)


def load_colossalai():
    """ColossalAI's (CachedEmbeddingBag, EvictionStrategy, how it was imported).

    Its package import runs colossalai/__init__ and legacy/nn/__init__, which pull in modules the cache never
    uses (galore_torch, bitsandbytes, transformers). Where that chain fails, the four files the class is made of
    (copyer, cache_mgr, base_embedding, cached_embedding: torch, numpy and contexttimer only) are loaded from the
    installed package as they are, and the JSON says so."""
    try:
        from colossalai.legacy.nn.parallel.layers import CachedEmbeddingBag, EvictionStrategy
        return CachedEmbeddingBag, EvictionStrategy, "colossalai.legacy.nn.parallel.layers"
    except ImportError as e:
        package_error = f"{type(e).__name__}: {e}"
    spec = importlib.util.find_spec("colossalai")
    if spec is None or not spec.submodule_search_locations:
        raise PeerUnavailable(f"not installed ({package_error})")
    folder = Path(list(spec.submodule_search_locations)[0]) / "legacy/nn/parallel/layers/cache_embedding"
    pkg_name = "_colossalai_cache_embedding"
    pkg = types.ModuleType(pkg_name)
    pkg.__path__ = [str(folder)]
    sys.modules[pkg_name] = pkg
    try:
        for part in ("copyer", "cache_mgr", "base_embedding", "cached_embedding"):
            part_spec = importlib.util.spec_from_file_location(f"{pkg_name}.{part}", folder / f"{part}.py")
            module = importlib.util.module_from_spec(part_spec)
            sys.modules[part_spec.name] = module
            part_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any failure here means the peer cannot run; say why
        raise PeerUnavailable(f"import error: {package_error}; loading {folder} directly: "
                              f"{type(e).__name__}: {e}") from e
    mgr = sys.modules[f"{pkg_name}.cache_mgr"]
    cls = sys.modules[f"{pkg_name}.cached_embedding"].CachedEmbeddingBag
    return cls, mgr.EvictionStrategy, f"files of {folder} (package import failed: {package_error})"


class ColossalAIPeer(Peer):
    name, label = "colossalai", "ColossalAI CachedEmbeddingBag (LFU)"

    def build(self, init, cfg, device):
        if device.type != "cuda":
            raise PeerUnavailable("needs CUDA: ColossalAI's CachedEmbeddingBag allocates its cache and index "
                                  "on torch.cuda.current_device()" + _import_note(load_colossalai))
        cls, strategy, self.imported_from = load_colossalai()
        self.batch = cfg.batch
        with contextlib.redirect_stdout(sys.stderr):  # it prints its warm-up time
            # pin_weight copies init into pinned memory (cachedemb's host table is pinned too).
            self.emb = cls(cfg.rows, cfg.dim, mode="sum", sparse=True, _weight=init, cache_ratio=cfg.cache_ratio,
                           evict_strategy=strategy.LFU, pin_weight=True, buffer_size=0)
        if self.emb.weight.data_ptr() == init.data_ptr():
            raise RuntimeError("ColossalAI kept the init tensor in place: it would train the shared init")
        self.opt = torch.optim.SGD(self.emb.parameters(), lr=cfg.lr)

    def step(self, ids, offsets):
        self.opt.zero_grad(set_to_none=True)
        loss_of(self.emb(ids, offsets[:-1]), self.batch).backward()
        self.opt.step()

    def counters(self):
        mgr = self.emb.cache_weight_mgr
        hits, misses = sum(int(h) for h in mgr.num_hits_history), sum(int(m) for m in mgr.num_miss_history)
        return {"unique": hits + misses, "hits": hits, "rows_in": mgr._cpu_to_cuda_numel // mgr.embedding_dim,
                "host_reads": 0}

    def info(self):
        return {"cache_rows": int(self.emb.cache_weight_mgr.cuda_row_num), "imported_from": self.imported_from,
                "version": version("colossalai"), "eviction": "LFU", "warmup_ratio": 0.7}

    def table(self):
        self.emb.cache_weight_mgr.flush()
        return self.emb.weight.detach().to("cpu", copy=True)


class FbgemmPeer(Peer):
    """`location="managed_caching"`: the UVM cache on a CUDA device. `"host"` (tests only): the same adapter over
    FBGEMM's CPU kernels, which the CPU package provides, so the adapter itself is checked without a GPU."""

    def __init__(self, location: str = "managed_caching"):
        self.location = location
        self.name = "fbgemm_uvm_caching" if location == "managed_caching" else f"fbgemm_{location}"
        self.label = "FBGEMM TBE, UVM caching (torchrec FUSED_UVM_CACHING)" if location == "managed_caching" \
            else f"FBGEMM TBE, {location}"

    @staticmethod
    def _import():
        try:
            from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
            from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
                CacheAlgorithm, ComputeDevice, EmbeddingLocation, PoolingMode)
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
        except ImportError as e:
            raise PeerUnavailable(
                f"not installed or import error ({type(e).__name__}: {e}); fbgemm-gpu 1.6.0 is the CUDA 13 build "
                "for torch 2.11 (a 465 MB wheel; scripts/fetch_peer_wheels.sh)") from e
        except Exception as e:  # noqa: BLE001 - a broken native build raises OSError/RuntimeError on import
            raise PeerUnavailable(f"import error: {type(e).__name__}: {e}") from e
        return (SplitTableBatchedEmbeddingBagsCodegen, EmbeddingLocation, ComputeDevice, PoolingMode,
                CacheAlgorithm, EmbOptimType, SparseType)

    def build(self, init, cfg, device):
        caching = self.location == "managed_caching"
        if caching and device.type != "cuda":
            raise PeerUnavailable("needs CUDA: FBGEMM's UVM caching kernel (EmbeddingLocation.MANAGED_CACHING) "
                                  "runs on a CUDA device only" + _import_note(self._import))
        tbe, location, compute, pooling, algorithm, optim, sparse = self._import()
        if not caching and device.type != "cpu":
            raise PeerUnavailable(f"location {self.location!r} is the CPU variant; this run is on {device}")
        spec = (cfg.rows, cfg.dim, location.MANAGED_CACHING if caching else location.HOST,
                compute.CUDA if caching else compute.CPU)
        kwargs = dict(optimizer=optim.EXACT_SGD, learning_rate=cfg.lr, pooling_mode=pooling.SUM,
                      weights_precision=sparse.FP32, output_dtype=sparse.FP32)
        if caching:
            # Host-mapped (cudaHostAlloc) rather than managed memory for the full table.
            kwargs.update(cache_load_factor=cfg.cache_ratio, cache_algorithm=algorithm.LRU,
                          gather_uvm_cache_stats=True, uvm_host_mapped=True, device=device)
        self.batch = cfg.batch
        self.emb = tbe([spec], **kwargs)
        with torch.no_grad():
            self.emb.split_embedding_weights()[0].copy_(init)
        if caching:
            self.emb.reset_cache_states()

    def step(self, ids, offsets):
        loss_of(self.emb(ids, offsets), self.batch).backward()

    def counters(self):
        if self.location != "managed_caching":
            return {}
        calls, requested, unique, unique_misses, conflict_unique, conflict = \
            self.emb.get_uvm_cache_stats().tolist()
        # Conflict misses found their 32-way set full: read from the host table, not inserted.
        return {"unique": unique, "hits": unique - unique_misses, "rows_in": unique_misses - conflict_unique,
                "host_reads": conflict}

    def info(self):
        info = {"version": version("fbgemm-gpu") or version("fbgemm-gpu-cpu"), "location": self.location}
        if self.location == "managed_caching":
            info.update(cache_rows=int(self.emb.lxu_cache_weights.shape[0]), cache_algorithm="LRU",
                        optimizer="EXACT_SGD")
        return info

    def table(self):
        if self.location == "managed_caching":
            self.emb.flush()
        return self.emb.split_embedding_weights()[0].detach().to("cpu", copy=True)


def _import_note(load) -> str:
    try:
        load()
        return ""
    except PeerUnavailable as e:
        return f"; here also {e}"


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_peers() -> list[Peer]:
    return [InMemoryPeer(), ColossalAIPeer(), FbgemmPeer(), CachedembPeer(prefetch=False),
            CachedembPeer(prefetch=True)]
