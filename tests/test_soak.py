"""Soak: many training steps through cachedemb.prefetch at small scale on CPU. Resident memory stays flat after
warm-up (bounded growth: no per-step history, buffers or tensors kept), and the counters stay consistent: every
distinct id of a batch is a hit or a miss (hits + misses = unique) and every admitted row is resident until
evicted (rows_in - evictions = resident rows). A short variant runs in CI; 10^5 steps with --slow."""
from __future__ import annotations

import os

import pytest
import torch

import cachedemb

NUM, DIM, CACHE, LOOKUPS = 4000, 8, 96, 64


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def zipf_batches(steps: int, seed: int = 0):
    """Skewed ids (a hot head, a long tail), generated lazily so the source holds nothing."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, NUM + 1, dtype=torch.float64)
    offsets = torch.tensor([0, LOOKUPS // 4, LOOKUPS // 2, 3 * LOOKUPS // 4])
    for _ in range(steps):
        yield torch.multinomial(weights, LOOKUPS, replacement=True, generator=g), offsets


def soak(steps: int, warmup: int, max_growth: int) -> None:
    torch.manual_seed(0)
    m = cachedemb.CachedEmbeddingBag(NUM, DIM, mode="sum", cache_rows=CACHE, device="cpu",
                                     optimizer=cachedemb.optim.RowWiseAdagrad(lr=0.05))
    rss_after_warmup = None
    for step, (ids, offsets) in enumerate(cachedemb.prefetch(zipf_batches(steps), [m], depth=4, horizon=16)):
        m(ids, offsets).pow(2).sum().backward()
        if step == warmup:
            rss_after_warmup = rss_bytes()
    growth = rss_bytes() - rss_after_warmup
    assert growth <= max_growth, f"RSS grew {growth / 2**20:.1f} MiB over {steps - warmup} steps after warm-up"

    stats = m.cache_stats()
    resident = int((m.cache.slot_ids[: m.cache.capacity] >= 0).sum())
    assert stats["hits"] + stats["misses"] == stats["unique"], stats
    assert stats["rows_in"] - stats["evictions"] == resident, (stats, resident)
    assert stats["lookups"] == steps * LOOKUPS
    # a window's admitted rows count as misses of the batch that first needs them: the forwards missed nothing else
    assert stats["windows"] > 0 and stats["hits"] > 0 and stats["misses"] == stats["window_misses"], stats
    assert not bool(m.cache.protected.any())
    assert torch.isfinite(m.weight).all()


def test_soak_short():
    soak(steps=250, warmup=50, max_growth=8 * 2**20)  # ~35 ms a step on a shared 2-core CPU


@pytest.mark.slow
def test_soak_long():
    soak(steps=100_000, warmup=5_000, max_growth=16 * 2**20)
